"""The cost of holding runs: one `runfleet runner` process with M runs in flight, each parked in
a call node that awaits `asyncio.sleep` (`bench.common:hold_for`), so all it does is keep M
leases (a refresh CAS + a working ack per run per interval).

Per M: lease-refresh writes/s and refresh latency p99 (from the runner's /metrics counter and
histogram over the window; the p99 is interpolated inside the histogram's buckets), the
process's CPU share (utime + stime from /proc/<pid>/stat over the window, in % of one core),
and RSS per in-flight run (VmRSS minus the idle VmRSS measured after a few warm-up runs).

    python -m bench.lease [--quick] [--inflight 100,1000] [--window 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/lease.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    QUICK_LEASE,
    SLEEP_NODE,
    Bench,
    LeaseEnv,
    Round,
    histogram_bucket,
    histogram_quantile,
    launch_many,
    loaded,
    machine,
    metric,
    run_main,
    table,
)
from engine.loader import LoadedWorkflow

REFRESHES = "runfleet_lease_refreshes_total"
LATENCY = "runfleet_lease_refresh_seconds"
INFLIGHT = "runfleet_inflight_runs"


async def launch_spread(rnd: Round, workflow: LoadedWorkflow, m: int, seconds: float) -> None:
    tasks = []
    t0 = time.monotonic()
    for i in range(m):
        delay = t0 + i * seconds / m - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        launch = rnd.publisher.launch(workflow, {"seconds": 86_400}, tenant="default")
        tasks.append(asyncio.ensure_future(launch))
    await asyncio.gather(*tasks)


async def measure(
    bench: Bench, m: int, window: float, idle_window: float, spread: bool = False
) -> dict[str, Any]:
    rnd = await bench.new_round(f"m{m}")
    try:
        (runner,) = await rnd.start_runners(1, m + 8)
        workflow = loaded(SLEEP_NODE)
        await launch_many(rnd.publisher, workflow, 5, {"seconds": 0.01}, concurrency=1)
        await rnd.wait_finished(5, within=60)
        await asyncio.sleep(1.0)
        idle_rss = runner.rss_kib()
        cpu0 = runner.cpu_seconds()
        await asyncio.sleep(idle_window)
        idle_cpu = (runner.cpu_seconds() - cpu0) / idle_window

        t0 = time.monotonic()
        if spread:  # claims, hence refresh beats, evenly over one interval
            await launch_spread(rnd, workflow, m, bench.lease.interval)
        else:
            await launch_many(rnd.publisher, workflow, m, {"seconds": 86_400}, concurrency=8)
        while metric(await asyncio.to_thread(runner.metrics), INFLIGHT) < m:
            if time.monotonic() - t0 > 120 + m / 10:
                raise TimeoutError(f"{m} runs not in flight")
            await asyncio.sleep(0.1)
        # Every lease keeper is on its beat after one interval; then the window.
        await asyncio.sleep(bench.lease.interval + 0.5)
        before = await asyncio.to_thread(runner.metrics)
        cpu0, w0 = runner.cpu_seconds(), time.monotonic()
        await asyncio.sleep(window)
        cpu1, w1 = runner.cpu_seconds(), time.monotonic()
        after = await asyncio.to_thread(runner.metrics)
        rss = runner.rss_kib()
        elapsed = w1 - w0
        refreshes = metric(after, REFRESHES, outcome="ok") - metric(before, REFRESHES, outcome="ok")
        p99 = histogram_quantile(0.99, after, before, LATENCY)
        p50 = histogram_quantile(0.50, after, before, LATENCY)
        bucket = histogram_bucket(0.99, after, before, LATENCY) or (float("nan"),) * 2
        return {
            "m": m,
            "inflight": metric(after, INFLIGHT),
            "refresh_per_s": refreshes / elapsed,
            "expected_per_s": m / bench.lease.interval,
            "refresh_p99_ms": (p99 or float("nan")) * 1e3,
            "refresh_p50_ms": (p50 or float("nan")) * 1e3,
            "p99_bucket": f"{bucket[0] * 1e3:g}-{bucket[1] * 1e3:g}",
            "cpu": (cpu1 - cpu0) / elapsed * 100,
            "idle_cpu": idle_cpu * 100,
            "idle_rss_mib": idle_rss / 1024,
            "rss_mib": rss / 1024,
            "rss_per_run_kib": (rss - idle_rss) / m,
        }
    finally:
        for r in rnd.runners:
            r.kill()  # a drain would hand M runs off: not what this measures
        await bench.end_round(rnd)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    ap.add_argument("--inflight", default="100,1000", help="comma-separated M values")
    ap.add_argument("--window", type=float, default=30.0, help="measurement window, s")
    ap.add_argument(
        "--spread",
        action="store_true",
        help="launch the M runs evenly over one lease interval (spread refresh beats)",
    )
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.inflight, args.window = "20", 2.0
    return args


async def main() -> int:
    args = parse()
    lease = QUICK_LEASE if args.quick else LeaseEnv()
    print(
        f"lease: one runner, lease interval {lease.interval:g}s, window {args.window:g}s;"
        f" {machine()}"
    )
    results: list[dict[str, Any]] = []
    async with Bench("lease", lease=lease, keep=args.keep) as bench:
        for m in (int(x) for x in args.inflight.split(",") if x):
            res = await measure(bench, m, args.window, 1.0 if args.quick else 5.0, args.spread)
            results.append(res)
            print(
                f"  M={m}: {res['refresh_per_s']:.1f} refreshes/s, CPU {res['cpu']:.1f}%,"
                f" {res['rss_per_run_kib']:.1f} KiB/run"
            )
    rows = [
        (
            int(r["m"]),
            r["refresh_per_s"],
            r["expected_per_s"],
            r["refresh_p50_ms"],
            r["refresh_p99_ms"],
            r["p99_bucket"],
            r["cpu"],
            r["idle_cpu"],
            r["idle_rss_mib"],
            r["rss_mib"],
            r["rss_per_run_kib"],
        )
        for r in results
    ]
    print()
    print(
        table(
            [
                "in flight",
                "refreshes/s",
                "expected/s",
                "refresh p50 ms",
                "refresh p99 ms",
                "p99 bucket ms",
                "CPU % of a core",
                "idle CPU %",
                "idle RSS MiB",
                "RSS MiB",
                "KiB/run",
            ],
            rows,
        )
    )
    top = results[-1]
    print(
        f"SUMMARY lease: M={int(top['m'])} refreshes={top['refresh_per_s']:.1f}/s"
        f" p99={top['refresh_p99_ms']:.1f} ms (bucket {top['p99_bucket']})"
        f" CPU={top['cpu']:.1f}% of a core"
        f" RSS={top['rss_per_run_kib']:.1f} KiB/run (targets at 1000: <= 25%, <= 100 KB)"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
