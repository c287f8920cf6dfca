"""The chaos soak (`tests/soak/`) at CI size: 12 runs through 3 runner processes while one
runner is drained (SIGTERM), the NATS server restarts (and a runner is drained while it is down),
the SQLite store refuses every write for longer than its busy timeout (once at a random moment,
once from the instant a run's `finished` status write goes), runners are SIGKILLed, and poison —
hostile bodies among it — lands on the work subject. Every run must finish, exactly once, with
each node's side effect repeated only where an interruption explains it.

Which fault proves which mechanism (each would fail this test if the mechanism were removed):
- SIGKILL mid-node: lease expiry, redelivery after `ack_wait`, adoption (SPEC §5.3, §5.4).
- the drain with NATS up: the handoff (§5.6) — the soak checks that every run the drained
  runner held mid-node was queued again as `attempt + 1` with `kind: handoff`, and that the
  runner exited 0 within the unwind ceiling.
- the drain while NATS is down: its handoff publishes fail, so only the orphan sweeper (§5.9)
  brings those runs back; without it they end `lost` (checked by hand: `--no-sweeper`).
- the store fault: `StoreUnavailable` at admission and at status writes (transient nak), lease
  loss and fencing (§5.4) — a run that loses its lease mid-node must be adopted, not duplicated.
- the post-engine store fault: a store that cannot take the status write (SPEC v2.2 §5.1, §5.6;
  ADR-0010) — the soak checks that the caught write was refused (`status not written`), that no
  DLQ record ever stood for a real run it did not dead-letter (none naming a store error), that
  no run stood `running` behind a record, and the run still finished once.
- the poison: admission's DLQ path; the DLQ must hold exactly the poison, with its reasons —
  the hostile bodies (5 000-digit integers, 200 000 nested arrays, a 1 MB string, wrong types
  at each field, a lying attempt header) each as one `malformed` record (§5.2 step 1).

Any violation fails the test; one that matches a finding of docs/reliability.md (F1-F4, fixed)
is named as that finding come back.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from store import utcnow
from tests.soak import SoakConfig, known_finding, run_soak
from tests.soak_hostile import hostile_bodies

pytestmark = pytest.mark.timeout(360)


async def test_a_small_chaos_soak_finishes_every_run_exactly_once(tmp_path: Path) -> None:
    seed = int(os.environ.get("RUNFLEET_SOAK_SEED") or random.SystemRandom().randrange(10**6))
    cfg = SoakConfig(
        runs=12,
        runners=3,
        slots=4,
        concurrency=6,
        kill_every=6.0,
        max_kills=3,
        seed=seed,
        data=tmp_path / "soak",
        store_fault_s=11.0,
        deadline_s=240.0,
        quiet=True,
    )
    report = await run_soak(cfg)
    summary = f"seed {seed} (RUNFLEET_SOAK_SEED={seed} repeats the plan)\n{report.table()}"

    # The faults happened, and each one had something to break.
    assert report.kills >= 2, summary
    assert report.nats_restarts == 1, summary
    assert report.store_fault_windows == 1, summary
    assert report.post_engine_windows == 1, summary
    assert report.post_engine_refused >= 1, (
        f"the post-engine store fault caught no status write the store refused\n{summary}"
    )
    # One drain in the clear (tried again while its runs finished first), then one in the outage.
    outages = [outage for outage, _ in report.drain_held]
    assert outages[-1] and not any(outages[:-1]) and len(outages) >= 2, summary
    assert all(held >= 1 for _, held in report.drain_held), (
        f"a drain held no run mid-node, so it proved nothing: {report.drain_held}\n{summary}"
    )
    assert report.handoffs >= 1, summary
    hostile = 2 * len(hostile_bodies("r", utcnow()))  # two poison batches
    assert report.hostile == hostile, summary
    assert report.poison >= 8 + hostile, summary

    named = [
        f"[finding {known_finding(v)} is back] {v}" if known_finding(v) else v
        for v in report.violations
    ]
    assert not named, "\n".join([summary, *named])
    assert report.runs == report.finished == 12, summary
    assert report.lost == report.duplicated == report.stuck == 0, summary
    assert report.dlq_records == report.poison, summary
    print(summary)  # `pytest -rP` shows the table of a passing soak
