"""The chaos soak: many runs through a real fleet while it is being broken on purpose.

    python -m tests.soak --runs 300 --runners 3 --kill-every 5 --seed 7 [--data DIR] [--keep]

(`--help` lists the options; every fault is on by default.)

The command line, and the soak's main flow from the top: `parse_args` turns the options into a
`SoakConfig`; `run_soak` (`run.py`) starts the fleet, drives the runs through the chaos, judges
them and cleans up; `main` prints the report's table and every violation (naming a known
finding that is back), and exits 1 on any violation, 0 on none. What the soak does and checks:
the package's docstring (`tests/soak/__init__.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from datetime import UTC, datetime
from pathlib import Path

from tests.soak.config import POST_ENGINE_FAULT_S, SoakConfig
from tests.soak.report import known_finding
from tests.soak.run import run_soak


def parse_args(argv: list[str] | None = None) -> SoakConfig:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--runners", type=int, default=3)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--kill-every", type=float, default=5.0, metavar="S")
    p.add_argument("--max-kills", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--data", type=Path, default=None, help="keep everything here")
    p.add_argument("--keep", action="store_true", help="keep the temp dir even on success")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--drains", type=int, default=1)
    p.add_argument("--nats-restarts", type=int, default=1)
    p.add_argument("--nats-outage-s", type=float, default=8.0, help="how long NATS stays down")
    p.add_argument("--nats-cluster", type=int, default=1, metavar="N", help="N servers, R=N")
    p.add_argument("--leader-kills", type=int, default=1, help="with --nats-cluster")
    p.add_argument("--leader-outage-s", type=float, default=5.0, help="a killed node's outage")
    p.add_argument(
        "--server-faults", type=int, default=0, metavar="N", help="with --nats-cluster: N faults"
    )
    p.add_argument("--pause-s", type=float, default=12.0, help="a SIGSTOPped node's pause")
    p.add_argument("--store-faults", type=int, default=1)
    p.add_argument("--store-fault-s", type=float, default=12.0)
    p.add_argument("--post-engine-store-faults", type=int, default=1, metavar="N")
    p.add_argument(
        "--post-engine-store-fault-s",
        type=float,
        default=POST_ENGINE_FAULT_S,
        metavar="S",
        help="how long the lock caught on a status write is held",
    )
    p.add_argument("--no-hostile-poison", action="store_true", help="poison without them")
    p.add_argument("--deadline", type=float, default=None, metavar="S")
    p.add_argument("--no-sweeper", action="store_true", help="runners without the sweeper")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 10**6)
    return SoakConfig(
        runs=a.runs,
        runners=a.runners,
        slots=a.slots,
        kill_every=a.kill_every,
        max_kills=a.max_kills,
        seed=seed,
        data=a.data,
        keep=a.keep,
        concurrency=a.concurrency,
        drains=a.drains,
        nats_restarts=a.nats_restarts,
        nats_outage_s=a.nats_outage_s,
        nats_cluster=a.nats_cluster,
        leader_kills=a.leader_kills,
        leader_outage_s=a.leader_outage_s,
        server_faults=a.server_faults,
        pause_s=a.pause_s,
        store_faults=a.store_faults,
        store_fault_s=a.store_fault_s,
        post_engine_store_faults=a.post_engine_store_faults,
        post_engine_store_fault_s=a.post_engine_store_fault_s,
        hostile_poison=not a.no_hostile_poison,
        deadline_s=a.deadline,
        quiet=a.quiet,
        sweeper=not a.no_sweeper,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"soak: seed {cfg.seed}, {cfg.runs} runs, {cfg.runners} runners, {started}", file=sys.stderr
    )
    report = asyncio.run(run_soak(cfg, handle_signals=True))
    print(report.table())
    print(f"\nseed {cfg.seed}; data {report.data_dir}" + ("" if report.ok else " (kept)"))
    for v in report.violations[:50]:
        tag = known_finding(v)
        print(f"VIOLATION{f' (finding {tag} is back)' if tag else ''}: {v}")
    if len(report.violations) > 50:
        print(f"... and {len(report.violations) - 50} more")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
