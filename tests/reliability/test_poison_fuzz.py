"""Poison fuzz (SPEC §3 DLQ records, §5.1, §5.2 steps 1-3): a seeded mix of random and mutated
messages published into the live work stream while a `runfleet runner` process serves it, and
good runs launched in between.

Each message has one expected fate, and every one is accounted for at the end — none vanishes:
- dead-lettered with its reason (a DLQ record whose id is its stream sequence, bytes kept, a body
  over 256 KiB in the blob store): binary garbage, truncated JSON, valid JSON with wrong types or
  unknown fields, header/body attempt mismatches, huge bodies → `malformed`; another tenant's
  message for a real run → `tenant_mismatch`; a lost run (old, or young until its last
  delivery) → `run_not_found`; an attempt ahead of its run, nak'd as a lagging read on each of
  its `max_deliver` deliveries, then recorded by the backstop → `attempt_ahead`; hostile bodies
  (`hostile.py`: integers past the 4 300-digit limit, deep nesting, huge strings, bad UTF-8,
  NaN, duplicate keys) → `malformed`, or whatever the decoder makes of them (a lost run's
  `run_not_found`, a newer schema), and always the extremes that escaped `decode` before v2.2:
  a 5 000-digit integer at every field, 200 000 nested arrays and objects (SPEC v2.2 §5.2);
- acked with its reason (gone from the stream, counted in `runfleet_deliveries_total`): a copy
  older than its run's attempt → `superseded`; a copy of a finished run's attempt → `settled`;
- nak'd and kept (still in the stream, not in the DLQ): a newer schema (`v` 2, 99) →
  `unsupported_schema` (a rolling upgrade waits 5 min).
The runner never crashes (its process lives, `/healthz` answers 200, no loop failed), and every
good run launched during the fuzz finishes exactly once.

`RUNFLEET_FUZZ_SEED=N` repeats a mix; the seed is in every failure message. The mix lives in
`poison.py`; `python -m tests.reliability.poison_fuzz` is the long mode (≥ 100 000 messages at
three runners, not CI; docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest

from publisher.dlq import INLINE_BODY_MAX
from tests.reliability.accounting import account, label
from tests.reliability.poison import (
    Poison,
    ack_key,
    expected_decode,
    generate,
    make_victims,
    metric_samples,
)
from tests.runner.conftest import Fleet, eventually
from tests.runner.conftest import fleet as fleet  # the fixture, shared with tests/runner
from tests.runner.procs import ledger, released, runner_process, workflow

pytestmark = pytest.mark.timeout(120)

MESSAGES = 240
GOOD_RUNS = 8
LAGGING = "0.3s"  # lost runs and attempts ahead reach their last delivery in ~3 s


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
        victims = await make_victims(fleet, book)
        assert victims.resumed.attempt == 2 and victims.finished.attempt == 1, why
        _, before = await proc.get("/metrics")

        poison = generate(victims, rng, MESSAGES)
        mislabelled = [
            (p.kind, p.reason, expected_decode(p.body, p.headers), p.body[:80])
            for p in poison
            if p.reason in ("malformed", "unsupported_schema")
            and expected_decode(p.body, p.headers) != p.reason
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

        missing: list[int] = []

        async def all_dead_lettered() -> bool:
            missing[:] = sorted(set(want_dlq) - {r.id for r in await fleet.dlq.list()})
            return not missing

        try:
            await eventually(all_dead_lettered, within=60, every=0.25)
        except AssertionError:
            kinds = [(seq, want_dlq[seq].kind, want_dlq[seq].reason) for seq in missing]
            raise AssertionError(
                f"{len(missing)} DLQ record(s) never came: {kinds[:10]} {why}\n"
                f"runner log tail:\n{proc.log()[-4000:]}"
            ) from None
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
    acc = await account(fleet, {seq: label(p) for seq, p in sent.items()})
    assert not acc.violations, f"{acc.violations[:10]} {why}"
    assert {seq for seq, o in acc.observed.items() if o == "in_stream"} == {
        seq for seq, p in sent.items() if p.fate == "nak"
    }, why

    # The runner's own account matches, reason by reason (deltas over the fuzz).
    fates = Counter((p.fate, p.reason) for p in sent.values())
    deliveries = metric_samples(after, "runfleet_deliveries") - metric_samples(
        before, "runfleet_deliveries"
    )
    for reason in ("superseded", "settled"):
        assert deliveries[ack_key(reason)] == fates["ack", reason], (
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
