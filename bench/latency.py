"""Latency of a one-node run: publish → claim and publish → finished, p50 / p95 / p99.

One fleet (R `runfleet runner` processes x S slots, SQLite store) serves three phases:
1. capacity: launch C runs with the runners stopped, start them, time first `run_claimed` →
   last `run_finished` (the drain rate of `bench.throughput`, measured again here);
2. low load: L runs one at a time (the next is launched once the previous is finished);
3. 50 % load: runs launched open-loop at half the capacity of phase 1 for D seconds.

"publish" is the moment the publisher calls `js.publish` for the run (a hook on `Publisher`);
"claim" and "finished" are the `at` of the run's `run_claimed` and `run_finished` events,
written by the runner processes (epoch milliseconds: the figures have 1 ms resolution). Since
issue 19, a one-node run's `run_claimed` rides with its `finished` write (ADR-0014), so its `at`
is the finish's: the two rows read the same, and "finished" is the figure that means something.

    python -m bench.latency [--quick] [--runners R] [--slots S] [--low-runs L] [--seconds D]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/latency.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    ONE_NODE,
    QUICK_LEASE,
    Bench,
    LeaseEnv,
    Round,
    launch_many,
    loaded,
    machine,
    percentile,
    run_main,
    table,
)
from publisher import Publisher
from store import RunDocument, RunStatus


class TimedPublisher(Publisher):
    """Records when each run's first publish starts (wall clock, like the events' `at`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.published: dict[str, float] = {}

    async def publish(self, run: RunDocument, kind: Any, **kwargs: Any) -> Any:
        self.published.setdefault(run.run_id, time.time())
        return await super().publish(run, kind, **kwargs)


def latencies(
    rnd: Round, pub: TimedPublisher, run_ids: list[str]
) -> tuple[list[float], list[float]]:
    times = rnd.event_times("run_claimed", "run_finished")
    claim = [(times["run_claimed"][r] - pub.published[r]) * 1e3 for r in run_ids]
    done = [(times["run_finished"][r] - pub.published[r]) * 1e3 for r in run_ids]
    return claim, done


async def capacity(rnd: Round, n: int, r: int, s: int) -> float:
    await launch_many(rnd.publisher, loaded(ONE_NODE), n, concurrency=8)
    await rnd.start_runners(r, s)
    await rnd.wait_finished(n, within=max(120.0, n / 20))
    await rnd.wait_events("run_finished", n)
    times = rnd.event_times("run_claimed", "run_finished")
    return n / (max(times["run_finished"].values()) - min(times["run_claimed"].values()))


async def low_load(rnd: Round, pub: TimedPublisher, n: int) -> list[str]:
    workflow = loaded(ONE_NODE)
    ids = []
    for _ in range(n):
        doc = await pub.launch(workflow, {}, tenant="default")
        ids.append(doc.run_id)
        deadline = time.monotonic() + 30
        while (await rnd.store.get_run(doc.run_id)).status is not RunStatus.FINISHED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {doc.run_id} not finished within 30s")
            await asyncio.sleep(0.005)
    return ids


async def open_loop(
    rnd: Round, pub: TimedPublisher, rate: float, seconds: float
) -> tuple[list[str], float]:
    """Launch at `rate` runs/s for `seconds` (each launch its own task, so a slow launch does
    not delay the schedule); returns the ids and the rate achieved."""
    workflow = loaded(ONE_NODE)
    n = max(int(rate * seconds), 1)
    ids: list[str] = []

    async def one() -> None:
        doc = await pub.launch(workflow, {}, tenant="default")
        ids.append(doc.run_id)

    tasks = []
    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)
    first = min(pub.published[r] for r in ids)
    last = max(pub.published[r] for r in ids)
    achieved = (n - 1) / (last - first) if last > first else float("nan")
    return ids, achieved


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    ap.add_argument("--runners", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--capacity-runs", type=int, default=5_000)
    ap.add_argument("--low-runs", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=20.0, help="duration of the 50%% phase")
    ap.add_argument("--load", type=float, default=0.5, help="fraction of capacity")
    ap.add_argument(
        "--rate", type=float, help="open-loop runs/s instead of --load x capacity (for A/B pairs)"
    )
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.runners, args.slots = 1, 4
        args.capacity_runs, args.low_runs, args.seconds = 100, 10, 1.0
    return args


async def main() -> int:
    args = parse()
    lease = QUICK_LEASE if args.quick else LeaseEnv()
    print(f"latency: {args.runners} runners x {args.slots} slots; {machine()}")
    async with Bench("latency", lease=lease, keep=args.keep) as bench:
        rnd = await bench.new_round("latency")
        assert bench.nc is not None and bench.js is not None
        pub = TimedPublisher(
            store=rnd.store, nc=bench.nc, js=bench.js, settings=rnd.wire, names=rnd.names
        )
        rnd.publisher = pub
        cap = await capacity(rnd, args.capacity_runs, args.runners, args.slots)
        print(f"  capacity (drain): {cap:,.0f} runs/s")
        await asyncio.sleep(1.0)
        low_ids = await low_load(rnd, pub, args.low_runs)
        print(f"  low load: {len(low_ids)} runs one at a time")
        target = args.rate if args.rate else cap * args.load
        loaded_ids, achieved = await open_loop(rnd, pub, target, args.seconds)
        total = args.capacity_runs + len(low_ids) + len(loaded_ids)
        await rnd.wait_finished(total, within=300)
        await rnd.wait_events("run_finished", total)
        print(f"  {args.load:.0%} load: {len(loaded_ids)} runs at {achieved:,.0f}/s")
        low = latencies(rnd, pub, low_ids)
        mid = latencies(rnd, pub, loaded_ids)
        await bench.end_round(rnd)

    rows = []
    phases = (("low (1 at a time)", low), (f"{args.load:.0%} ({achieved:,.0f}/s)", mid))
    for label, (claim, done) in phases:
        for what, values in (("publish → claim", claim), ("publish → finished", done)):
            rows.append(
                (
                    label,
                    what,
                    len(values),
                    percentile(values, 50),
                    percentile(values, 95),
                    percentile(values, 99),
                    max(values),
                )
            )
    print()
    print(table(["load", "latency", "runs", "p50 ms", "p95 ms", "p99 ms", "max ms"], rows))
    print(
        f"SUMMARY latency: capacity={cap:,.0f} runs/s;"
        f" low claim p50={percentile(low[0], 50):.1f} p99={percentile(low[0], 99):.1f} ms,"
        f" finished p50={percentile(low[1], 50):.1f} p99={percentile(low[1], 99):.1f} ms;"
        f" {args.load:.0%} ({achieved:,.0f}/s) claim p50={percentile(mid[0], 50):.1f}"
        f" p99={percentile(mid[0], 99):.1f} ms, finished p50={percentile(mid[1], 50):.1f}"
        f" p99={percentile(mid[1], 99):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
