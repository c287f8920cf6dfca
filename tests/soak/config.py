"""What one soak is asked to do and the fleet's timings: `SoakConfig` (the command line's
options, the tests' sizes) and the short timings every runner process gets as `RUNFLEET_*`
(`TIMING`), with the bounds the checks derive from them. Its own module because the fleet, the
faults, the checks and the command line all read it, and `tests/soak_scratch.py` runs its own
fleet on the same `TIMING`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

TENANT = "default"

# Short timings (the runner tests' values): ack_wait = TTL + skew = 3.5 s; the unwind ceiling
# is 5 + 1 + 10 + 5 + 1 = 22 s. The sweeper passes every second and republishes after 3 s.
# The transient ladder (SPEC §5.5) doubles from 1 s per delivery; its cap is 8 s, not the
# default 10 min: a run that spent most of its deliveries on the chaos (store faults, kills, the
# NATS outage) and then failed `flaky` at delivery 8 was nak'd for 128 s and outlived a CI
# soak's deadline waiting, correctly, for it (CI on e6f18f7, seed 211765).
TIMING = {
    "LEASE_TTL": "3s",
    "LEASE_INTERVAL": "1s",
    "LEASE_SKEW": "0.5s",
    "LEASE_LOSS_MARGIN": "0.5s",
    "NODE_CANCEL_BUDGET": "5s",
    "TEARDOWN_BUDGET": "10s",
    "SCRATCH_BANK_BUDGET": "5s",
    "POST_ENGINE_BUDGET": "5s",
    "UNWIND_MARGIN": "1s",
    "SWEEPER_INTERVAL": "1s",
    "SWEEPER_GRACE": "3s",
    "DUPLICATE_WINDOW": "30s",
    "PUBLISH_ATTEMPTS": "2",
    "PUBLISH_RETRY_BUDGET": "2s",
    "PUBLISH_TIMEOUT": "1s",
    "TRANSIENT_DELAY": "1s",
    "TRANSIENT_DELAY_CAP": "8s",
    "MAX_DELIVER": "10",
}
ACK_WAIT_S = 3.5
UNWIND_CEILING_S = 22.0
SWEEPER_INTERVAL_S = 1.0
SWEEPER_GRACE_S = 3.0
SQLITE_BUSY_TIMEOUT_S = 10.0
POST_ENGINE_FAULT_S = 2 * SQLITE_BUSY_TIMEOUT_S + 2.0
"""Past two busy timeouts: a runner's store thread takes its writes in batches, and the caught
status write may be queued behind a batch that began just before it (a lease refresh); that
batch fails at one busy timeout, the status write's batch at two."""
POST_ENGINE_CATCH_S = 60.0
"""How long an armed post-engine fault waits for a `finished` status write to catch."""


@dataclass
class SoakConfig:
    runs: int = 300
    runners: int = 3
    slots: int = 4
    kill_every: float = 5.0
    seed: int = 1
    data: Path | None = None
    keep: bool = False
    max_kills: int | None = None
    """Stop killing after this many SIGKILLs (None: keep killing until the runs are done)."""
    concurrency: int = 24
    """Runs launched and not yet finished, at most."""
    drains: int = 1
    nats_restarts: int = 1
    nats_outage_s: float = 8.0
    """How long nats-server stays down (a pod rescheduled takes longer than a restart)."""
    store_faults: int = 1
    store_fault_s: float = 12.0
    post_engine_store_faults: int = 1
    post_engine_store_fault_s: float = POST_ENGINE_FAULT_S
    """A store outage opened on a caught `finished` status write (`tests/soak_seam.py`)."""
    poison_per_batch: int = 4
    hostile_poison: bool = True
    """Send `tests/soak_hostile.py`'s bodies with every poison batch."""
    cli_resume_every: int = 10
    deadline_s: float | None = None
    """Whole-soak deadline; default 600 s + 3 s per run."""
    quiet: bool = False
    sweeper: bool = True
    """`False` runs the runners with `RUNFLEET_SWEEPER=false` (to show the soak catches it)."""
    nats_cluster: int = 1
    """Above 1: a local JetStream cluster of that many servers, streams at that many replicas."""
    leader_kills: int = 1
    """With a cluster: SIGKILLs of the runs stream's leader (each restarted)."""
    leader_outage_s: float = 5.0
    server_faults: int = 0
    """With a cluster: faults of `tests.soak_cluster.KINDS`, in turn (each restarted)."""
    pause_s: float = 12.0
    """How long a paused node stays SIGSTOPped: past `ack_wait` (3.5 s) and past raft's election
    timeout (3.5-7 s measured), so the others elect a leader while it sleeps."""

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else 600.0 + 3.0 * self.runs


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value
