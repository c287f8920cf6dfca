"""The sweeper's pass over a backlog: CPU and wall time of one `Sweeper.sweep_once` over N
queued runs whose messages are all still on the queue (issue 19: ≤ 1 s of CPU at 50 000).

    python -m bench.sweep [--runs N] [--quick]

Launches N one-node runs (no runner consumes them), then runs passes with the sweeper's clock
set ten minutes ahead, so every run is past the lease interval and the grace: each one is a
candidate for the gone-message check, and none needs an action (its copy is on the queue). That
is the worst pass a backlog makes. A last pass after deleting `--gone` of the messages shows the
cost of the actions themselves (a republish each). CPU is this process's (all threads: the
sweeper, the SQLite store's thread, the NATS client); the server is another process.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # `python bench/sweep.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ONE_NODE, QUICK_LEASE, Bench, launch_many, loaded, machine, run_main, table


async def main(args: argparse.Namespace) -> int:
    from engine.config import EngineSettings
    from engine.sandbox.local import LocalSandboxDriver
    from runner.config import RunnerSettings
    from runner.runner import Runner
    from runner.sweeper import Sweeper
    from store import utcnow
    from store.blobs_fs import FilesystemBlobStore

    print(f"# bench.sweep: {machine()}")
    async with Bench("sweep", lease=QUICK_LEASE) as bench:
        rnd = await bench.new_round("sweep")
        assert bench.js is not None
        n = args.runs
        t0 = time.perf_counter()
        ids = await launch_many(rnd.publisher, loaded(ONE_NODE), n, concurrency=16)
        await rnd.publisher.flush()
        print(f"launched {n} runs in {time.perf_counter() - t0:.1f} s")
        blobs = FilesystemBlobStore(rnd.dir / "blobs")
        runner = Runner(
            store=rnd.store,
            driver=LocalSandboxDriver(rnd.dir / "data"),
            data_dir=rnd.dir / "data",
            blobs=blobs,
            settings=RunnerSettings(slots=1, http_host="127.0.0.1", sweeper=False, backstop=False),
            engine=EngineSettings(),
            wire=rnd.wire,
            owner="bench-sweep",
            consume=False,
        )
        await runner.start()
        ahead = timedelta(minutes=10)
        sweeper = Sweeper(runner.svc, clock=lambda: utcnow() + ahead)
        rows = []
        for label in [f"nothing to do, pass {i + 1}" for i in range(args.passes)]:
            w0, c0 = time.perf_counter(), time.process_time()
            report = await sweeper.sweep_once(force=True)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            rows.append([label, n, f"{cpu:.3f}", f"{wall:.3f}", dict(report.actions) or "-"])
        gone = random.sample(ids, min(args.gone, n))
        for run_id in gone:
            doc = await rnd.store.get_run(run_id)
            assert doc.publication is not None and doc.publication.stream_seq is not None
            await bench.js.delete_msg(rnd.names.runs_stream, doc.publication.stream_seq)
        w0, c0 = time.perf_counter(), time.process_time()
        report = await sweeper.sweep_once(force=True)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        rows.append(
            [f"{len(gone)} copies gone", n, f"{cpu:.3f}", f"{wall:.3f}", dict(report.actions)]
        )
        print(table(["pass", "queued runs", "CPU s", "wall s", "actions"], rows))
        best = min(float(r[2]) for r in rows[: args.passes])
        print(
            f"SUMMARY sweep: a pass over {n} queued runs, nothing to do:"
            f" {best:.3f} s CPU (best of {args.passes})"
        )
        await runner.shutdown()
        await blobs.close()
        await bench.end_round(rnd)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50_000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--gone", type=int, default=100, help="messages deleted before the last pass")
    ap.add_argument("--quick", action="store_true", help="300 runs (the CI smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.passes, args.gone = 300, 1, 10
    run_main(lambda: main(args))
