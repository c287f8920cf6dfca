"""The chaos soak (`tests/soak/`) on a three-node JetStream cluster, at CI size (issue 21):
8 runs through 3 runner processes, every stream at three replicas, runner SIGKILLs, poison, and
one SIGKILL of the node leading the runs stream (restarted a few seconds later, once the
survivors have elected a new leader). Every run must finish, exactly once.

What the leader kill breaks, and what saves it: the clients connected to the killed node
reconnect to another (the comma-separated `RUNFLEET_NATS_URL`); until raft's election timeout
elects a new leader (~4-6 s measured) publishes get no responders and acks and pulls go
unanswered — saved by the publisher's retries and the sweeper (§4, §5.9), the redelivery after
`ack_wait` and the lease fence (§5.3, §5.4, SPEC §13 inv. 1, 2, 4). The single-server soak
(`test_soak_small.py`) covers the other faults; they are off here to keep CI's time.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.soak import SoakConfig, known_finding, run_soak

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]


async def test_a_cluster_soak_with_a_stream_leader_kill_finishes_every_run_exactly_once(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("RUNFLEET_SOAK_SEED") or random.SystemRandom().randrange(10**6))
    cfg = SoakConfig(
        runs=8,
        runners=3,
        slots=4,
        concurrency=6,
        kill_every=6.0,
        max_kills=2,
        seed=seed,
        data=tmp_path / "soak",
        drains=0,
        nats_restarts=0,
        store_faults=0,
        post_engine_store_faults=0,
        nats_cluster=3,
        leader_kills=1,
        leader_outage_s=3.0,
        deadline_s=200.0,
        quiet=True,
    )
    report = await run_soak(cfg)
    summary = f"seed {seed} (RUNFLEET_SOAK_SEED={seed} repeats the plan)\n{report.table()}"

    assert report.leader_kills == 1, summary
    assert report.max_leaderless_s > 0, summary
    assert report.kills >= 1, summary
    named = [
        f"[finding {known_finding(v)} is back] {v}" if known_finding(v) else v
        for v in report.violations
    ]
    assert not named, "\n".join([summary, *named])
    assert report.runs == report.finished == 8, summary
    assert report.lost == report.duplicated == report.stuck == 0, summary
    assert report.dlq_records == report.poison, summary
    print(summary)  # `pytest -rP` shows the table of a passing soak
