"""One runner in this process, draining a launched backlog: runner CPU per run and store calls
per run, fast enough to measure a change in seconds (the profile loop of issue 19).

    python -m bench.inproc [--runs N] [--slots S] [--launch-concurrency C]

Launch first (timed: one awaited producer, or C of them), then start one in-process runner and
time the drain. CPU is this process's (`time.process_time`, all threads) over the drain only, so
it is the runner's: the NATS server is another process. Not a capacity figure (one process, one
core's worth): `bench.throughput` is.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from bench.common import ONE_NODE, QUICK_LEASE, Bench, CountingStore, launch_many, loaded, run_main


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) per thread of this process, by thread name, from /proc
    (threads of one name summed: each SQLite store has its own thread, named by its file)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name.split("-")[0] for t in threading.enumerate()}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def main(args: argparse.Namespace) -> int:
    from engine.config import EngineSettings
    from engine.sandbox.local import LocalSandboxDriver
    from publisher import Publisher
    from runner.config import RunnerSettings
    from runner.runner import Runner
    from store.blobs_fs import FilesystemBlobStore
    from store.sqlite import SqliteRunStore

    async with Bench("inproc", lease=QUICK_LEASE) as bench:
        rnd = await bench.new_round("inproc")
        assert bench.nc is not None and bench.js is not None
        wrap = CountingStore if args.count else (lambda inner: inner)
        pub_store = wrap(rnd.store)
        publisher = Publisher(
            store=pub_store,  # type: ignore[arg-type]
            nc=bench.nc, js=bench.js, settings=rnd.wire, names=rnd.names,
        )  # fmt: skip
        runner_store = wrap(await SqliteRunStore.open(rnd.db_path))
        blobs = FilesystemBlobStore(rnd.dir / "blobs")
        runner = Runner(
            store=runner_store,  # type: ignore[arg-type]
            driver=LocalSandboxDriver(rnd.dir / "data"),
            data_dir=rnd.dir / "data",
            blobs=blobs,
            settings=RunnerSettings(
                slots=args.slots, http_host="127.0.0.1", sweeper=False, backstop=False
            ),
            engine=EngineSettings(),
            wire=rnd.wire,
            owner="bench-inproc",
        )
        n = args.runs
        t0, c0 = time.perf_counter(), time.process_time()
        await launch_many(publisher, loaded(ONE_NODE), n, concurrency=args.launch_concurrency)
        launch_s, launch_cpu = time.perf_counter() - t0, time.process_time() - c0
        threads0 = _thread_cpu()
        t0, c0, os0 = time.perf_counter(), time.process_time(), os.times()
        await runner.start()
        await rnd.wait_finished(n, within=max(120.0, n / 5), every=0.02)
        drain_s, drain_cpu = time.perf_counter() - t0, time.process_time() - c0
        os1 = os.times()
        threads1 = _thread_cpu()
        await runner.shutdown()
        await runner_store.close()
        await blobs.close()
        await bench.end_round(rnd)
        print(
            f"launch: {n / launch_s:,.0f} runs/s, {launch_cpu / n * 1e3:.2f} ms CPU/run"
            f" (publisher side)\ndrain:  {n / drain_s:,.0f} runs/s,"
            f" {drain_cpu / n * 1e3:.2f} ms CPU/run (runner side, incl. the poller)"
        )
        split = {
            name: (cpu - threads0.get(name, 0.0)) / n * 1e3
            for name, cpu in threads1.items()
            if cpu - threads0.get(name, 0.0) > 0
        }
        print("drain CPU by thread, ms/run: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
        user, system = (os1.user - os0.user) / n * 1e3, (os1.system - os0.system) / n * 1e3
        print(f"drain CPU by mode, ms/run: user {user:.2f}, system (the kernel: I/O) {system:.2f}")
        print(
            f"SUMMARY inproc: drain {n / drain_s:,.0f} runs/s,"
            f" {drain_cpu / n * 1e3:.2f} ms CPU/run (one in-process runner, {args.slots} slots)"
        )
        for side, store in (("publisher", pub_store), ("runner", runner_store)):
            if not isinstance(store, CountingStore):
                continue
            calls = {k: v.calls / n for k, v in sorted(store.ops.items()) if k != "close"}
            writes = sum(v for k, v in calls.items() if k in CountingStore.WRITES)
            shown = ", ".join(f"{k} {v:.2f}" for k, v in calls.items())
            print(f"{side}: {writes:.2f} writes/run ({shown})")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--launch-concurrency", type=int, default=1)
    ap.add_argument(
        "--no-count", dest="count", action="store_false", help="no counting wrapper (its cost)"
    )
    ap.add_argument("--quick", action="store_true", help="100 runs (the CI smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.runs = 100
    run_main(lambda: main(args))
