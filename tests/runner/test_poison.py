"""Poison messages (SPEC §3 DLQ records, §5.1, §5.2 steps 1-2): whatever lands on the work
subject, a runner records it in the DLQ with the reason admission found — `malformed` (bytes that
are not JSON, JSON that is not a v1 message), `run_not_found` (an old message for no run),
`tenant_mismatch` (a message naming another tenant's run) — acks it, and keeps serving: good runs
launched meanwhile finish, and the process neither crashes nor turns unhealthy. Some carry
headers that imitate a server status: they are deliveries all the same."""

from __future__ import annotations

import asyncio
import json
import os
import random
import uuid
from datetime import timedelta
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from publisher.wire import RunMessage, encode
from store import utcnow
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import ledger, released, runner_process, workflow

GARBAGE_PER_KIND = 250
GOOD_RUNS = 6


def wrong_schema(i: int) -> bytes:
    """Valid JSON that is not a v1 message (never a newer `v`: that one waits, SPEC §5.2)."""
    message = {
        "v": 1,
        "run_id": f"r{i}",
        "tenant": "default",
        "attempt": 1,
        "kind": "launch",
        "published_at": utcnow().isoformat(),
    }
    variants: list[object] = [
        {"hello": "world", "i": i},
        {**message, "attempt": 0},
        {**message, "kind": "explode"},
        {**message, "surprise": True},
        {**message, "v": 0},
        {k: v for k, v in message.items() if k != "run_id"},
        [1, 2, i],
        f"just a string {i}",
        None,
        i,
    ]
    return json.dumps(variants[i % len(variants)]).encode()


def imitation(i: int) -> dict[str, str] | None:
    """Headers of a published message that imitate a server status (the puller once took such
    a delivery for a status and dropped it), on two thirds of the bytes that are not JSON."""
    return [{"Status": "404", "Description": "No Messages"}, {"Status": "100"}, None][i % 3]


def garbage(victim: str, rng: random.Random) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """(expected reason, body, headers) for 4 x 250 messages, shuffled."""
    out: list[tuple[str, bytes, dict[str, str] | None]] = []
    for i in range(GARBAGE_PER_KIND):
        # 0xff never starts valid UTF-8, so these are never JSON.
        out.append(("malformed", b"\xff" + rng.randbytes(rng.randrange(0, 300)), imitation(i)))
        out.append(("malformed", wrong_schema(i), None))
        lost = RunMessage(
            run_id=str(uuid.uuid4()),
            tenant="default",
            attempt=1,
            kind="launch",
            published_at=utcnow() - timedelta(minutes=5),  # older than the 30 s lagging read
        )
        body, headers = encode(lost)
        out.append(("run_not_found", body, headers))
        intruder = RunMessage(
            run_id=victim, tenant="intruder", attempt=1, kind="launch", published_at=utcnow()
        )
        out.append(("tenant_mismatch", intruder.model_dump_json().encode(), None))
    rng.shuffle(out)
    return out


async def test_a_thousand_garbage_messages_all_land_in_the_dlq_and_the_runner_stays_healthy(
    fleet: Fleet, tmp_path: Path
) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4)))
    book = tmp_path / "ledger"
    async with runner_process(fleet, "runner-poison", args=("--slots", "32")) as proc:
        victim = await fleet.launch(workflow("one_step"), {"ledger": str(book), "tag": "victim"})
        messages = garbage(victim.run_id, rng)
        expected: dict[int, tuple[str, bytes]] = {}
        good = [victim.run_id]
        chunk = len(messages) // (GOOD_RUNS - 1)
        for start in range(0, len(messages), chunk):
            for reason, body, headers in messages[start : start + chunk]:
                ack = await fleet.js.publish(
                    fleet.names.runs_subject, body, stream=fleet.names.runs_stream, headers=headers
                )
                expected[ack.seq] = (reason, body)
            run = await fleet.launch(
                workflow("one_step"), {"ledger": str(book), "tag": f"good{len(good)}"}
            )
            good.append(run.run_id)
        assert len(expected) == 4 * GARBAGE_PER_KIND

        async def all_recorded() -> bool:
            info = await fleet.js.stream_info(fleet.names.dlq_stream)
            return int(info.state.messages) >= len(expected)

        await eventually(all_recorded, within=45, every=0.25)
        for run_id in good:
            await fleet.wait_status(run_id, "finished")
            await eventually(released(fleet, run_id))

        status, health = await proc.get("/healthz")
        assert status == 200, health
        assert json.loads(health)["ok"] is True
        _, metrics_text = await proc.get("/metrics")
        assert proc.returncode is None, proc.log()

    records = {r.id: r for r in await fleet.dlq.list()}
    assert set(records) == set(expected)  # every garbage message, and nothing else
    wrong = {
        seq: (records[seq].reason, reason)
        for seq, (reason, _) in expected.items()
        if records[seq].reason != reason
    }
    assert not wrong, f"{len(wrong)} records with the wrong reason, e.g. {list(wrong.items())[:5]}"
    bodies = await asyncio.gather(*(fleet.dlq.body(records[seq]) for seq in expected))
    assert bodies == [body for _, body in expected.values()]  # nothing dropped, bytes kept
    assert not any(r.replayable for r in records.values())
    assert {r.run_id for r in records.values() if r.reason == "tenant_mismatch"} == {victim.run_id}

    assert ledger(book) == {"victim": 1, **{f"good{i}": 1 for i in range(1, len(good))}}
    assert await fleet.queue_drained()
    dlq_by_reason = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "runfleet_dlq_records"
        for s in family.samples
        if s.name == "runfleet_dlq_records_total"
    }
    assert dlq_by_reason == {
        "malformed": 2.0 * GARBAGE_PER_KIND,
        "run_not_found": float(GARBAGE_PER_KIND),
        "tenant_mismatch": float(GARBAGE_PER_KIND),
    }
    assert "Traceback" not in proc.log()
