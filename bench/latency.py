"""Latency of a one-node run: publish → claim and publish → finished, p50 / p95 / p99.

One fleet (R `runfleet runner` processes x S slots, SQLite store) serves five phases:
1. capacity: launch C runs with the runners stopped, start them, time first `run_claimed` →
   last `run_finished` (the drain rate of `bench.throughput`, measured again here);
2. low load: L runs one at a time (the next is launched once the previous is finished);
3. e2e capacity: E runs launched by K concurrent launchers while the runners work, timed
   first publish → last `run_finished`: what the whole machine sustains with this script's
   launcher on the same cores;
4. 50 % load: runs launched open-loop at half the capacity of phase 1 for D seconds (issue 19's
   target row);
5. 50 % of e2e: the same at half the capacity of phase 3.

`--rates R1,R2,…` replaces phases 4 and 5 with one open-loop phase per rate, in that order, on
the same fleet, and ends with the sweep: each rate's p99 and busy share, and the highest rate
up to which every p99 stayed within `--target-ms` (the knee). One figure at "half load" says
where one point of that curve falls; the sweep says where the curve bends, and so what a
capacity figure is worth to a caller who waits (docs/performance.md, sixteenth pass).

Phases 3 to 5 also say where the machine's CPU went: the runners, this script (the launcher:
building, writing and publishing each run), nats-server, and the machine's busy share. At half
of the drain capacity the launcher and nats-server ask for CPU the capacity phase did not
share, so that phase can run the two cores near full; phase 5 is half of what the machine
sustains with them in the loop.

"publish" is the moment the publisher calls `js.publish` for the run (a hook on `Publisher`);
"claim" and "finished" are the `at` of the run's `run_claimed` and `run_finished` events,
written by the runner processes (epoch milliseconds: the figures have 1 ms resolution). Since
issue 19, a one-node run's `run_claimed` rides with its `finished` write (ADR-0014), so its `at`
is the finish's: the two rows read the same, and "finished" is the figure that means something.

    python -m bench.latency [--quick] [--runners R] [--slots S] [--low-runs L] [--seconds D]
        [--rate R | --rates R1,R2,… [--target-ms T]] [--drain-only]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
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
    machine_cpu_seconds,
    percentile,
    process_cpu_seconds,
    run_main,
    table,
)
from bench.pacing import open_loop as paced
from publisher import Publisher
from runner.heap import freeze_startup_heap
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


@dataclass(frozen=True)
class CpuShare:
    """Where the machine's CPU went during one phase, in CPU seconds."""

    runs: int
    runners: float
    launcher: float
    nats: float
    busy: float
    total: float

    def line(self) -> str:
        per = 1e3 / max(self.runs, 1)
        return (
            f"runners {self.runners * per:.2f}, launcher {self.launcher * per:.2f},"
            f" nats-server {self.nats * per:.2f} ms CPU/run; machine {self.busy_pct:.0f} % busy"
        )

    @property
    def busy_pct(self) -> float:
        return 100 * self.busy / self.total if self.total else float("nan")


class CpuMeter:
    """Reads the CPU of the runners, this process and nats-server, and the machine's, at the
    start of a phase and again at its end (/proc: Linux only, as the rest of `bench`)."""

    def __init__(self, rnd: Round, nats_pid: int | None) -> None:
        self.rnd = rnd
        self.nats_pid = nats_pid
        self._start = self._read()
        self._launched: float | None = None

    def launches_done(self) -> None:
        """The launcher's share ends here: what this process spends afterwards is the script
        waiting for the runs to finish, not launching."""
        self._launched = time.process_time()

    def _read(self) -> tuple[float, float, float, float, float]:
        runners = sum(r.cpu_seconds() for r in self.rnd.runners)
        nats = process_cpu_seconds(self.nats_pid) if self.nats_pid else 0.0
        busy, total = machine_cpu_seconds()
        return runners, time.process_time(), nats, busy, total

    def share(self, runs: int) -> CpuShare:
        end = self._read()
        if self._launched is not None:
            end = (end[0], self._launched, *end[2:])
        delta = [b - a for a, b in zip(self._start, end, strict=True)]
        return CpuShare(runs, *delta)


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


async def e2e_capacity(
    rnd: Round, pub: TimedPublisher, n: int, launchers: int, before: int, meter: CpuMeter
) -> tuple[float, CpuShare]:
    """`n` runs launched by `launchers` concurrent launchers while the runners work; the rate
    first publish → last `run_finished`, and the CPU spent until the last one finished."""
    ids = await launch_many(pub, loaded(ONE_NODE), n, concurrency=launchers)
    meter.launches_done()
    await rnd.wait_finished(before + n, within=max(120.0, n / 20))
    share = meter.share(n)
    await rnd.wait_events("run_finished", before + n)
    finished = rnd.event_times("run_finished")["run_finished"]
    first = min(pub.published[r] for r in ids)
    last = max(finished[r] for r in ids)
    return n / (last - first), share


async def open_loop(
    rnd: Round, pub: TimedPublisher, rate: float, seconds: float
) -> tuple[list[str], float]:
    """Launch at `rate` runs/s for `seconds` (`bench.pacing`: each launch its own task, so a
    slow launch does not delay the schedule); returns the ids and the rate achieved."""
    workflow = loaded(ONE_NODE)
    ids: list[str] = []

    async def one() -> None:
        doc = await pub.launch(workflow, {}, tenant="default")
        ids.append(doc.run_id)

    n = await paced(rate, seconds, one)
    first = min(pub.published[r] for r in ids)
    last = max(pub.published[r] for r in ids)
    achieved = (n - 1) / (last - first) if last > first else float("nan")
    return ids, achieved


def parse_rates(text: str) -> list[float]:
    """`--rates`: comma-separated positive runs/s."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of runs/s: {text!r}") from None
    if not rates or any(rate <= 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive runs/s: {text!r}")
    return rates


@dataclass(frozen=True)
class SweepPoint:
    """One open-loop phase of a `--rates` sweep: finished p50 / p99 in ms."""

    asked: float
    achieved: float
    p50: float
    p99: float
    cpu: CpuShare


def knee(points: list[SweepPoint], target_ms: float) -> float:
    """The highest rate up to which every phase's p99 stayed within `target_ms` (rates in
    ascending order; a rate past the first miss does not count, however it came out): 0 when
    the first one missed."""
    best = 0.0
    for point in sorted(points, key=lambda p: p.asked):
        if point.p99 > target_ms:
            break
        best = point.achieved
    return best


def sweep_table(points: list[SweepPoint], capacity: float) -> str:
    rows = [
        (
            f"{p.asked:,.0f}",
            f"{p.achieved:,.0f}",
            f"{p.achieved / capacity:.0%}",
            f"{p.cpu.busy_pct:.0f} %",
            f"{p.p50:.1f}",
            f"{p.p99:.1f}",
        )
        for p in points
    ]
    return table(["runs/s asked", "achieved", "of drain", "machine busy", "p50 ms", "p99 ms"], rows)


def dump(
    path: Path,
    phase: str,
    pub: TimedPublisher,
    ids: list[str],
    claim: list[float],
    done: list[float],
) -> None:
    """Appends one row per run: phase, seconds since the phase's first publish, the publish's
    epoch seconds, publish → claim and publish → finished in ms. A tail that clusters in time
    is a stall (a launcher's garbage collection was one); one spread evenly is queueing."""
    first = min(pub.published[r] for r in ids)
    new = not path.exists()
    with path.open("a", encoding="utf-8") as out:
        if new:
            out.write("phase,t_s,published_at,claim_ms,finished_ms\n")
        for run_id, c, d in sorted(
            zip(ids, claim, done, strict=True), key=lambda row: pub.published[row[0]]
        ):
            at = pub.published[run_id]
            out.write(f"{phase},{at - first:.4f},{at:.4f},{c:.1f},{d:.1f}\n")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    ap.add_argument("--runners", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--capacity-runs", type=int, default=5_000)
    ap.add_argument("--low-runs", type=int, default=300)
    ap.add_argument("--e2e-runs", type=int, default=3_000, help="runs of the e2e capacity phase")
    ap.add_argument("--launchers", type=int, default=16, help="its concurrent launchers")
    ap.add_argument("--seconds", type=float, default=20.0, help="duration of the 50%% phase")
    ap.add_argument("--load", type=float, default=0.5, help="fraction of capacity")
    fixed = ap.add_mutually_exclusive_group()
    fixed.add_argument(
        "--rate", type=float, help="open-loop runs/s instead of --load x capacity (for A/B pairs)"
    )
    fixed.add_argument(
        "--rates",
        type=parse_rates,
        help="comma-separated open-loop runs/s, one phase each, in order, then the sweep's knee",
    )
    ap.add_argument(
        "--target-ms",
        type=float,
        default=50.0,
        help="the p99 the sweep's knee is read against (issue 19: 50 ms)",
    )
    ap.add_argument(
        "--drain-only",
        action="store_true",
        help="skip phases 3 and 5 (the e2e capacity and half of it): for A/B pairs at --rate",
    )
    ap.add_argument(
        "--dump",
        type=Path,
        help="write each loaded run's publish time and latencies here (CSV), to see when the"
        " tail happened",
    )
    ap.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the launcher's start-up heap to the garbage collector (the old launcher)",
    )
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.runners, args.slots = 1, 4
        args.capacity_runs, args.low_runs, args.seconds = 100, 10, 1.0
        args.e2e_runs, args.launchers = 100, 4
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
        if not args.no_freeze:
            frozen = freeze_startup_heap()
            print(f"  launcher: {frozen:,} start-up objects frozen out of the gc (ADR-0016)")
        cap = await capacity(rnd, args.capacity_runs, args.runners, args.slots)
        print(f"  capacity (drain): {cap:,.0f} runs/s")
        await asyncio.sleep(1.0)
        low_ids = await low_load(rnd, pub, args.low_runs)
        print(f"  low load: {len(low_ids)} runs one at a time")
        total = args.capacity_runs + len(low_ids)
        e2e_cap = float("nan")
        if not args.drain_only:
            e2e_cap, e2e_cpu = await e2e_capacity(
                rnd, pub, args.e2e_runs, args.launchers, total, CpuMeter(rnd, bench.server.pid)
            )
            total += args.e2e_runs
            print(f"  e2e capacity ({args.launchers} launchers): {e2e_cap:,.0f} runs/s;")
            print(f"    {e2e_cpu.line()}")
            await asyncio.sleep(1.0)
        loads = [(f"{args.load:.0%} of drain", cap * args.load)]
        if args.rate:
            loads = [("fixed rate", args.rate)]
        if args.rates:
            loads = [(f"rate {rate:g}/s", rate) for rate in args.rates]
        if not args.drain_only and not args.rates:
            loads.append((f"{args.load:.0%} of e2e", e2e_cap * args.load))
        phases: list[tuple[str, tuple[list[float], list[float]]]] = [
            ("low (1 at a time)", latencies(rnd, pub, low_ids))
        ]
        summary: list[str] = []
        sweep: list[SweepPoint] = []
        for name, target in loads:
            meter = CpuMeter(rnd, bench.server.pid)
            loaded_ids, achieved = await open_loop(rnd, pub, target, args.seconds)
            meter.launches_done()
            total += len(loaded_ids)
            await rnd.wait_finished(total, within=300)
            cpu = meter.share(len(loaded_ids))
            await rnd.wait_events("run_finished", total)
            print(f"  {name}: {len(loaded_ids)} runs at {achieved:,.0f}/s;")
            print(f"    {cpu.line()}")
            claim, done = latencies(rnd, pub, loaded_ids)
            if args.dump:
                dump(args.dump, name, pub, loaded_ids, claim, done)
            phases.append((f"{name} ({achieved:,.0f}/s)", (claim, done)))
            sweep.append(
                SweepPoint(target, achieved, percentile(done, 50), percentile(done, 99), cpu)
            )
            summary.append(
                f" {name} ({achieved:,.0f}/s) claim p50={percentile(claim, 50):.1f}"
                f" p99={percentile(claim, 99):.1f} ms, finished p50={percentile(done, 50):.1f}"
                f" p99={percentile(done, 99):.1f} ms, machine {cpu.busy_pct:.0f} % busy"
            )
            await asyncio.sleep(1.0)
        await bench.end_round(rnd)

    rows = []
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
    low = phases[0][1]
    print()
    print(table(["load", "latency", "runs", "p50 ms", "p95 ms", "p99 ms", "max ms"], rows))
    if args.rates:
        print()
        print(sweep_table(sweep, cap))
        within = knee(sweep, args.target_ms)
        found = (
            f"p99 ≤ {args.target_ms:g} ms up to {within:,.0f} runs/s ({within / cap:.0%} of drain)"
            if within
            else f"p99 > {args.target_ms:g} ms from the first rate"
        )
        print(f"  sweep: {found}")
        summary.append(f" sweep knee={within:,.0f} runs/s at p99 ≤ {args.target_ms:g} ms")
    print(
        f"SUMMARY latency: capacity={cap:,.0f} runs/s, e2e capacity={e2e_cap:,.0f} runs/s;"
        f" low claim p50={percentile(low[0], 50):.1f} p99={percentile(low[0], 99):.1f} ms,"
        f" finished p50={percentile(low[1], 50):.1f} p99={percentile(low[1], 99):.1f} ms;"
        + ";".join(summary)
    )
    return 0


if __name__ == "__main__":
    run_main(main)
