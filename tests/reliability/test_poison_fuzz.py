"""Poison fuzz (SPEC §3 DLQ records, §5.1, §5.2 steps 1-3): a seeded mix of random and mutated
messages published into the live work stream while a `runfleet runner` process serves it, and
good runs launched in between.

Each message has one expected fate, and every one is accounted for at the end — none vanishes:
- dead-lettered with its reason (a DLQ record whose id is its stream sequence, bytes kept, a body
  over 256 KiB in the blob store): binary garbage, truncated JSON, valid JSON with wrong types or
  unknown fields, header/body attempt mismatches, huge bodies → `malformed`; another tenant's
  message for a real run → `tenant_mismatch`; a lost run (old, or young until its last
  delivery) → `run_not_found`; an attempt ahead of its run, nak'd as a lagging read on each of
  its `max_deliver` deliveries, then recorded by the backstop → `attempt_ahead`;
- acked with its reason (gone from the stream, counted in `runfleet_deliveries_total`): a copy
  older than its run's attempt → `superseded`; a copy of a finished run's attempt → `settled`;
- nak'd and kept (still in the stream, not in the DLQ): a newer schema (`v` 2, 99) →
  `unsupported_schema` (a rolling upgrade waits 5 min).
The runner never crashes (its process lives, `/healthz` answers 200, no loop failed), and every
good run launched during the fuzz finishes exactly once.

`RUNFLEET_FUZZ_SEED=N` repeats a mix; the seed is in every failure message.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from engine.resume import ResumeRequest
from publisher import MalformedMessage, UnsupportedSchema
from publisher.dlq import INLINE_BODY_MAX
from publisher.wire import HDR_ATTEMPT, HDR_MSG_ID, RunMessage, decode, encode
from store import RunDocument, utcnow
from tests.runner.conftest import Fleet, eventually
from tests.runner.conftest import fleet as fleet  # the fixture, shared with tests/runner
from tests.runner.procs import ledger, released, runner_process, workflow

pytestmark = pytest.mark.timeout(120)

MESSAGES = 240
GOOD_RUNS = 8
LAGGING = "0.3s"  # lost runs and attempts ahead reach their last delivery in ~3 s

ASK = """\
name: ask
entry: ask
nodes:
  ask:
    kind: human
    questions:
      - name: ok
        type: bool
  done:
    kind: compute
    set:
      x: "1"
edges:
  - from: ask
    to: done
"""


@dataclass(frozen=True)
class Poison:
    kind: str
    body: bytes
    headers: dict[str, str] | None
    fate: str
    """`dlq`, `ack` or `nak`."""
    reason: str


@dataclass(frozen=True)
class Victims:
    finished: RunDocument
    """Finished at attempt 1."""
    resumed: RunDocument
    """Paused, resumed, finished at attempt 2."""


def _valid(victims: Victims, rng: random.Random) -> dict[str, Any]:
    run = rng.choice([victims.finished, victims.resumed])
    return {
        "v": 1,
        "run_id": run.run_id,
        "tenant": run.tenant,
        "attempt": run.attempt,
        "kind": rng.choice(["launch", "resume", "replay", "handoff", "sweep"]),
        "published_at": utcnow().isoformat(),
    }


WRONG_VALUES: dict[str, list[Any]] = {
    "v": ["1", "one", 0, -1, None, [1], {"v": 1}],
    "run_id": [123, "", None, ["r"], {"id": "r"}],
    "tenant": ["", 5, None, ["default"]],
    "attempt": ["one", 1.5, 0, -3, None, [1], "1e3x"],
    "kind": ["explode", 1, None, "", "LAUNCH"],
    "published_at": ["yesterday", "2026-13-45T99:99:99Z", [], {"at": 1}],
    "resume": ["yes", 5, [1, 2], {"answers": "not a dict"}, {"surprise": True}],
}


def generate(victims: Victims, rng: random.Random) -> list[Poison]:
    """MESSAGES poison messages, every kind twice then a seeded mix, and a few over 256 KiB."""
    out: list[Poison] = []

    def garbage() -> Poison:
        body = b"\xff" + rng.randbytes(rng.randrange(0, 512))  # 0xff never starts UTF-8
        return Poison("garbage", body, None, "dlq", "malformed")

    def not_json() -> Poison:
        text = rng.choice(["{not json", "", " ", "nul", "[1,", '{"v":1,', "\x00\x01", "}{"])
        return Poison("not_json", text.encode(), None, "dlq", "malformed")

    def truncated() -> Poison:
        body = json.dumps(_valid(victims, rng)).encode()
        return Poison(
            "truncated", body[: rng.randrange(1, len(body) - 1)], None, "dlq", "malformed"
        )

    def wrong_type() -> Poison:
        message = _valid(victims, rng)
        key = rng.choice(sorted(WRONG_VALUES))
        message[key] = rng.choice(WRONG_VALUES[key])
        return Poison(f"wrong_{key}", json.dumps(message).encode(), None, "dlq", "malformed")

    def reshaped() -> Poison:
        message = _valid(victims, rng)
        choice = rng.randrange(4)
        if choice == 0:
            message.pop(rng.choice(sorted(set(message) - {"v"})))  # `v` has a default
        elif choice == 1:
            message[f"x{rng.randrange(100)}"] = "surprise"
        elif choice == 2:
            return Poison("not_an_object", json.dumps([message]).encode(), None, "dlq", "malformed")
        else:
            return Poison(
                "scalar",
                json.dumps(rng.choice([None, 7, "s", 1.5, True])).encode(),
                None,
                "dlq",
                "malformed",
            )
        return Poison("reshaped", json.dumps(message).encode(), None, "dlq", "malformed")

    def huge() -> Poison:
        size = INLINE_BODY_MAX + rng.randrange(1, 200_000)
        if rng.random() < 0.5:
            body = b"\xff" + rng.randbytes(size)
        else:
            message = _valid(victims, rng)
            message["padding"] = "x" * size  # an unknown field: invalid
            body = json.dumps(message).encode()
        return Poison("huge", body, None, "dlq", "malformed")

    def header_mismatch() -> Poison:
        message = _valid(victims, rng)
        header = rng.choice([str(message["attempt"] + rng.randrange(1, 5)), "abc", "-1", "01"])
        return Poison(
            "header_mismatch",
            json.dumps(message).encode(),
            {HDR_ATTEMPT: header},
            "dlq",
            "malformed",
        )

    def newer_schema() -> Poison:
        message = _valid(victims, rng)
        message["v"] = rng.choice([2, 3, 99, 10**6])
        if rng.random() < 0.5:
            message["field_from_the_future"] = {"nested": [1, 2, 3]}
        return Poison(
            "newer_schema", json.dumps(message).encode(), None, "nak", "unsupported_schema"
        )

    def future_attempt() -> Poison:
        run = rng.choice([victims.finished, victims.resumed])
        message = RunMessage(
            run_id=run.run_id,
            tenant=run.tenant,
            attempt=run.attempt + rng.randrange(1, 1000),
            kind=rng.choice(["resume", "handoff", "sweep"]),
            published_at=utcnow(),
        )
        body, headers = encode(message)
        headers[HDR_MSG_ID] = uuid.uuid4().hex  # never deduplicated away
        return Poison("future_attempt", body, headers, "dlq", "attempt_ahead")

    def other_tenant() -> Poison:
        message = _valid(victims, rng)
        message["tenant"] = rng.choice(["intruder", "Default", "default ", "t" * 200])
        return Poison("other_tenant", json.dumps(message).encode(), None, "dlq", "tenant_mismatch")

    def lost_run() -> Poison:
        old = rng.random() < 0.5
        message = RunMessage(
            run_id=str(uuid.uuid4()),
            tenant="default",
            attempt=rng.randrange(1, 5),
            kind="launch",
            published_at=utcnow()
            - (timedelta(minutes=rng.randrange(1, 600)) if old else timedelta(0)),
        )
        body, headers = encode(message)
        return Poison("lost_old" if old else "lost_young", body, headers, "dlq", "run_not_found")

    def superseded() -> Poison:
        message = _valid(victims, rng)
        message.update(run_id=victims.resumed.run_id, attempt=victims.resumed.attempt - 1)
        return Poison("superseded", json.dumps(message).encode(), None, "ack", "superseded")

    def settled() -> Poison:
        message = _valid(victims, rng)
        return Poison("settled", json.dumps(message).encode(), None, "ack", "settled")

    kinds: list[Callable[[], Poison]] = [
        garbage,
        not_json,
        truncated,
        wrong_type,
        wrong_type,
        reshaped,
        header_mismatch,
        newer_schema,
        future_attempt,
        other_tenant,
        lost_run,
        superseded,
        settled,
    ]
    for i in range(MESSAGES):
        make = kinds[i % len(kinds)] if i < 2 * len(kinds) else rng.choice(kinds)
        out.append(make())
    out += [huge() for _ in range(4)]
    rng.shuffle(out)
    return out


def expected_decode(poison: Poison) -> str | None:
    """What the product's decoder says: a cross-check that the generator labels its messages as
    the wire contract does (a mislabelled message would make the fuzz test itself wrong)."""
    try:
        decode(poison.body, poison.headers)
    except MalformedMessage:
        return "malformed"
    except UnsupportedSchema:
        return "unsupported_schema"
    return None


def metric_samples(text: str, family_name: str) -> Counter[tuple[str, ...]]:
    out: Counter[tuple[str, ...]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                out[tuple(sorted(s.labels.values()))] += int(s.value)
    return out


async def _victims(fleet: Fleet, book: Path) -> Victims:
    finished = await fleet.launch(workflow("one_step"), {"ledger": str(book), "tag": "victim"})
    asked = await fleet.launch(ASK)
    await fleet.wait_status(asked.run_id, "paused_waiting_human")
    await eventually(released(fleet, asked.run_id))
    await fleet.publisher.resume(
        asked.run_id, ResumeRequest(cli_answers={"ok": "yes"}), tenant="default"
    )
    done = [
        await fleet.wait_status(finished.run_id, "finished"),
        await fleet.wait_status(asked.run_id, "finished"),
    ]
    for doc in done:
        await eventually(released(fleet, doc.run_id))
    assert await fleet.queue_drained()
    return Victims(
        finished=await fleet.store.get_run(finished.run_id),
        resumed=await fleet.store.get_run(asked.run_id),
    )


async def test_fuzzed_poison_is_all_accounted_for_and_the_runner_keeps_serving(
    fleet: Fleet, tmp_path: Path
) -> None:
    seed = int(os.environ.get("RUNFLEET_FUZZ_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    why = f"(seed {seed}; RUNFLEET_FUZZ_SEED={seed} repeats it)"
    book = tmp_path / "ledger"
    async with runner_process(
        fleet, "fuzz", args=("--slots", "16"), env={"RUNFLEET_LAGGING_DELAY": LAGGING}
    ) as proc:
        victims = await _victims(fleet, book)
        assert victims.resumed.attempt == 2 and victims.finished.attempt == 1, why
        _, before = await proc.get("/metrics")

        poison = generate(victims, rng)
        mislabelled = [
            (p.kind, p.reason, expected_decode(p), p.body[:80])
            for p in poison
            if p.reason in ("malformed", "unsupported_schema") and expected_decode(p) != p.reason
        ]
        assert not mislabelled, f"the generator disagrees with the wire contract {why}: " + str(
            mislabelled[:5]
        )

        sent: dict[int, Poison] = {}
        good: list[str] = []
        every = len(poison) // GOOD_RUNS + 1
        for i, p in enumerate(poison):
            ack = await fleet.js.publish(
                fleet.names.runs_subject, p.body, stream=fleet.names.runs_stream, headers=p.headers
            )
            assert not ack.duplicate, f"{p.kind} was deduplicated away {why}"
            sent[ack.seq] = p
            if i % every == 0:
                run = await fleet.launch(
                    workflow("one_step"), {"ledger": str(book), "tag": f"good{len(good)}"}
                )
                good.append(run.run_id)

        want_dlq = {seq: p for seq, p in sent.items() if p.fate == "dlq"}

        async def all_dead_lettered() -> bool:
            return {r.id for r in await fleet.dlq.list()} >= set(want_dlq)

        await eventually(all_dead_lettered, within=60, every=0.25)
        for run_id in good:
            await fleet.wait_status(run_id, "finished", within=30)
            await eventually(released(fleet, run_id))

        status, health = await proc.get("/healthz")
        assert status == 200 and json.loads(health)["ok"] is True, f"{health} {why}"
        _, after = await proc.get("/metrics")
        assert proc.returncode is None, f"the runner died {why}:\n{proc.log()}"
        log = proc.log()
        assert "task loop:" not in log, f"a runner loop failed {why}:\n{log}"

    # Dead-lettered: exactly the messages meant for the DLQ, each with its reason, bytes kept.
    records = {r.id: r for r in await fleet.dlq.list()}
    victim_ids = {victims.finished.run_id, victims.resumed.run_id}
    assert set(records) == set(want_dlq), (
        f"DLQ extra {sorted(set(records) - set(want_dlq))[:10]}"
        f" missing {[(s, want_dlq[s].kind) for s in sorted(set(want_dlq) - set(records))][:10]}"
        f" {why}"
    )
    wrong = [
        (seq, want_dlq[seq].kind, records[seq].reason, want_dlq[seq].reason)
        for seq in want_dlq
        if records[seq].reason != want_dlq[seq].reason
    ]
    assert not wrong, f"wrong DLQ reasons (seq, kind, got, want) {wrong[:10]} {why}"
    bodies = await asyncio.gather(*(fleet.dlq.body(records[seq]) for seq in want_dlq))
    assert bodies == [p.body for p in want_dlq.values()], f"a DLQ body changed {why}"
    for seq, p in want_dlq.items():
        rec = records[seq]
        assert (rec.body_key is not None) == (len(p.body) > INLINE_BODY_MAX), (rec, why)
        assert not rec.replayable, (rec.reason, why)
        if rec.reason == "tenant_mismatch":
            assert rec.run_id in victim_ids, (rec, why)
        if rec.reason == "attempt_ahead":  # settled by the backstop after the last delivery
            assert rec.runner.startswith("backstop:"), (rec, why)
            assert rec.num_delivered == fleet.wire.max_deliver, (rec, why)

    # Acked: gone from the stream, not dead-lettered. Nak'd: still in the stream, waiting.
    for seq, p in sent.items():
        if p.fate == "dlq":
            continue
        try:
            await fleet.js.get_msg(fleet.names.runs_stream, seq)
            present = True
        except NotFoundError:
            present = False
        assert present == (p.fate == "nak"), f"seq {seq} ({p.kind}): in stream {present} {why}"

    # The runner's own account matches, reason by reason (deltas over the fuzz).
    fates = Counter((p.fate, p.reason) for p in sent.values())
    deliveries = metric_samples(after, "runfleet_deliveries") - metric_samples(
        before, "runfleet_deliveries"
    )
    for reason in ("superseded", "settled"):
        assert deliveries[tuple(sorted(("ack", reason)))] == fates["ack", reason], (
            reason,
            deliveries,
            why,
        )
    assert (
        deliveries[tuple(sorted(("nak", "unsupported_schema")))]
        == fates["nak", "unsupported_schema"]
    ), (deliveries, why)
    ahead = fates["dlq", "attempt_ahead"] * fleet.wire.max_deliver  # every delivery nak'd
    assert deliveries[tuple(sorted(("nak", "lagging_read")))] == ahead, (deliveries, why)
    dlq_metric = metric_samples(after, "runfleet_dlq_records") - metric_samples(
        before, "runfleet_dlq_records"
    )
    by_reason = Counter(p.reason for p in want_dlq.values())
    assert {k[0]: v for k, v in dlq_metric.items()} == dict(by_reason), (dlq_metric, why)

    # Good runs flowed through it all, each exactly once; the victims were never touched again.
    assert ledger(book) == {"victim": 1, **{f"good{i}": 1 for i in range(len(good))}}, why
    for victim in (victims.finished, victims.resumed):
        now = await fleet.store.get_run(victim.run_id)
        assert (now.status, now.attempt, now.version) == (
            victim.status,
            victim.attempt,
            victim.version,
        ), why
