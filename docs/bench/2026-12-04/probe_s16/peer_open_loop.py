"""Open-loop latency of the peers: enqueue at a fixed rate, enqueue call -> completion p50/p99.

The peer benches (`../shared/peer-bench`) measure e2e with one producer awaiting each enqueue,
so their latency is read at whatever rate that producer reaches. `bench.latency --rate R
--drain-only` reads runfleet's at a rate chosen in advance. This probe does the same to
PgQueuer and Procrastinate, reusing each peer bench's worker processes unchanged (2 workers,
PgQueuer batch 10, Procrastinate concurrency 16, as in `run_all.sh`): each enqueue is its own
task at its scheduled time (a pool of 8 connections), so a slow enqueue does not delay the
schedule: the same `bench.pacing.open_loop` that `bench.latency` launches on.

    cd <peer-bench copy> && ./pg.sh start
    <copy>/venv/bin/python peer_open_loop.py --peer-dir <copy> --peer pgqueuer --rate 700

Prints one JSON line: the rate achieved, the latency summary, the machine's busy share and
the workers' and Postgres's CPU per run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repo: `bench.pacing`
from bench.pacing import open_loop  # noqa: E402  (dependency-free: runs in the peers' venv)


def busy_total() -> tuple[float, float]:
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


async def enqueue_open_loop(rate: float, seconds: float, enqueue: Any) -> tuple[dict[str, float], float]:
    """`bench.pacing.open_loop` (the schedule `bench.latency` launches on) over the peer's
    enqueue; returns each job's enqueue-call time and the rate achieved."""
    at: dict[str, float] = {}

    async def one() -> None:
        t = time.time()
        jid = await enqueue()
        at[str(jid)] = t

    n = await open_loop(rate, seconds, one)
    first, last = min(at.values()), max(at.values())
    return at, (n - 1) / (last - first) if last > first else float("nan")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(args.peer_dir))
    pb = importlib.import_module(f"{args.peer}_bench")
    pc = importlib.import_module("peercommon")
    workdir = args.peer_dir / "work"
    rdir = workdir / f"{args.peer}-open-{uuid.uuid4().hex[:8]}"
    rdir.mkdir(parents=True)
    db = f"peer_{args.peer}_open"
    pc.pg_fresh_db(db)
    dsn = pc.pg_url(db)
    workers: list[Any] = []
    if args.peer == "pgqueuer":
        import asyncpg
        from pgqueuer import AsyncpgDriver, AsyncpgPoolDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(dsn)
        await Queries(AsyncpgDriver(conn)).install()
        await conn.close()
        base = {"dsn": dsn, "batch": 10, "max_concurrent": 0, "dequeue_timeout": 30.0}
        watch = await asyncpg.connect(dsn)
        pool = await asyncpg.create_pool(dsn, min_size=8, max_size=8)
        queries = Queries(AsyncpgPoolDriver(pool))

        async def enqueue() -> Any:
            (jid,) = await queries.enqueue(pb.ENTRYPOINT, None)
            return jid

        async def close() -> None:
            await pool.close()
            await watch.close()
    else:
        import psycopg

        app = pb.make_app(dsn, pool_max=2)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
        base = {"dsn": dsn, "concurrency": 16, "poll": 5.0}
        watch = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        app = pb.make_app(dsn, pool_max=8)
        task = app.tasks[pb.TASK]
        await app.open_async()

        async def enqueue() -> Any:
            return await task.defer_async()

        async def close() -> None:
            await app.close_async()
            await watch.close()

    pgcpu = pc.CommCpu("postgres")
    try:
        pgcpu.start()
        for i in range(2):
            workers.append(
                pb.Worker(
                    {**base, "index": i, "out": str(rdir / f"worker-{i}.json")},
                    rdir / f"worker-{i}.log",
                )
            )
        for w in workers:
            w.wait_ready()
        await asyncio.sleep(1.0)
        cpu0 = sum(w.cpu() for w in workers)
        b0, t0 = busy_total()
        proc0 = time.process_time()
        at, achieved = await enqueue_open_loop(args.rate, args.seconds, enqueue)
        producer = time.process_time() - proc0
        await pb.wait_done(watch, len(at), workers, within=300)
        b1, t1 = busy_total()
        worker_cpu = sum(w.cpu() for w in workers) - cpu0
        db_cpu, _ = pgcpu.stop()
        reports = [w.stop() for w in workers]
        await close()
    finally:
        for w in workers:
            w.kill()
    done: dict[str, float] = {}
    for r in reports:
        done.update(r["done"])
    lat = [done[i] - at[i] for i in at]
    n = len(at)
    out = {
        "peer": args.peer,
        "rate_asked": args.rate,
        "rate_achieved": round(achieved, 1),
        "n": n,
        **pc.latency_summary(lat, "enqueue_to_done"),
        "machine_busy_pct": round(100 * (b1 - b0) / (t1 - t0), 1),
        "worker_cpu_ms_per_run": round(worker_cpu / n * 1e3, 3),
        "producer_cpu_ms_per_run": round(producer / n * 1e3, 3),
        "postgres_cpu_ms_per_run": round(db_cpu / n * 1e3, 3),
    }
    import shutil

    shutil.rmtree(rdir, ignore_errors=True)
    pc.pg_drop_db(db)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peer-dir", type=Path, required=True)
    ap.add_argument("--peer", choices=["pgqueuer", "procrastinate"], required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
