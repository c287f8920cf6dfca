"""Capacity: raw JetStream (A, the transport baseline) against runfleet (B), drain and e2e.

A: 1 KiB messages on a work-queue stream of the same server, R consumer processes x S tasks,
   each task `fetch(batch=100, timeout=0.1)` + `ack()` on its own pull subscription.
B: runs of a one-node `compute` workflow on the SQLite store, R `runfleet runner` processes x
   S slots.

drain: publish / launch N with nothing consuming, then start the consumers; time first
       delivery → last ack (A, from the consumers' clocks) / first `run_claimed` → last
       `run_finished` (B, from the store's events).
e2e:   consumers up, one producer awaiting each publish / launch; time first publish → last
       ack / last `run_finished`. B also prints p50 / p99 from each launch call to its run's
       `run_finished`: what `../shared/peer-bench` reports as e2e `lat` (enqueue call →
       completion), so the two read side by side.

Each mode is measured `--rounds` times (fresh streams and store each round); the table shows
every round and the medians; B/A is the ratio of the medians. A last in-process pass runs B's
runner over a counting store wrapper: store calls, awaited time and stored bytes per run.

    python -m bench.throughput [--quick] [--runners R] [--slots S] [--runs N] [--rounds K]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/throughput.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from bench.common import (
    ONE_NODE,
    QUICK_LEASE,
    Bench,
    CountingStore,
    LeaseEnv,
    RunnerProc,
    launch_many,
    loaded,
    machine,
    median,
    metric,
    percentile,
    run_main,
    table,
)

PAYLOAD = b"x" * 1024


@dataclass
class Result:
    mode: str
    round: int
    count: int
    seconds: float
    cpu_ms_per_run: float = float("nan")
    """B only: CPU (utime + stime) of all runner processes over the round, per run."""
    kib_per_run: float = float("nan")
    """B only: bytes the runner processes wrote to storage (WAL, checkpoints, logs), per run."""
    producer_cpu_ms: float = float("nan")
    """B e2e only: CPU of this process (the one awaited producer) per launch."""
    per_pull: float = float("nan")
    """B only: messages per pull that delivered any (`runfleet_fetch_messages`), all runners."""
    latency_ms: tuple[float, float] = (float("nan"), float("nan"))
    """B e2e only: p50 and p99 from the launch call to the run's `run_finished`, the peers'
    "enqueue call → completion" (their e2e `lat` columns)."""

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("nan")


# -- A: the transport baseline ----------------------------------------------------------------


async def consumer_child(url: str, stream: str, durable: str, tasks: int) -> None:
    """One baseline consumer process: `tasks` fetch+ack loops. Prints `ready`, starts on a
    `go` line on stdin, stops on SIGTERM and prints its first-delivery and last-ack times."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    subs = [await js.pull_subscribe_bind(durable, stream=stream) for _ in range(tasks)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    first = float("inf")
    last = 0.0
    acked = 0

    async def loop(psub: object) -> None:
        nonlocal first, last, acked
        while not stop.is_set():
            try:
                msgs = await psub.fetch(100, timeout=0.1)  # type: ignore[attr-defined]
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            if msgs:
                first = min(first, time.time())
            for m in msgs:
                await m.ack()
            acked += len(msgs)
            last = time.time()

    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # "go"
    workers = [asyncio.ensure_future(loop(s)) for s in subs]
    await stop.wait()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    await nc.flush()
    print(json.dumps({"first": first, "last": last, "acked": acked}), flush=True)
    await nc.close()


class Consumers:
    """R baseline consumer processes, started together."""

    def __init__(self, url: str, stream: str, durable: str, procs: int, tasks: int) -> None:
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.throughput",
                    "--consumer-child",
                    url,
                    stream,
                    durable,
                    str(tasks),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=str(Path(__file__).resolve().parents[1]),
            )
            for _ in range(procs)
        ]

    async def ready(self) -> None:
        for p in self.procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            if line.strip() != b"ready":
                raise RuntimeError(f"baseline consumer did not start: {line!r}")

    def go(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()

    async def stop(self) -> tuple[float, float, int]:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        firsts, lasts, total = [], [], 0
        for p in self.procs:
            out, _ = await asyncio.to_thread(p.communicate, None, 30)
            report = json.loads(out.decode().strip().splitlines()[-1])
            if report["acked"]:
                firsts.append(report["first"])
                lasts.append(report["last"])
            total += report["acked"]
        return min(firsts), max(lasts), total

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


async def baseline_round(bench: Bench, mode: str, index: int, n: int, r: int, s: int) -> Result:
    assert bench.js is not None
    js = bench.js
    tag = f"BENCHA{index}{mode}{int(time.time() * 1000) % 100000}"
    subject = f"{tag.lower()}.msgs"
    await js.add_stream(
        StreamConfig(
            name=tag,
            subjects=[subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
        )
    )
    await js.add_consumer(
        tag,
        ConsumerConfig(
            durable_name="c",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            max_deliver=10,
            max_ack_pending=-1,
        ),
    )
    consumers = Consumers(bench.server.url, tag, "c", r, s)
    try:
        if mode == "drain":
            for start in range(0, n, 1000):
                await asyncio.gather(
                    *(js.publish(subject, PAYLOAD) for _ in range(min(1000, n - start)))
                )
            await consumers.ready()
            consumers.go()
            await _wait_empty(bench, tag)
            first, last, acked = await consumers.stop()
            return Result(mode, index, acked, last - first)
        await consumers.ready()
        consumers.go()
        await asyncio.sleep(0.3)  # let every fetch loop issue its first pull
        t0 = time.time()
        for _ in range(n):
            await js.publish(subject, PAYLOAD)
        await _wait_empty(bench, tag)
        _, last, acked = await consumers.stop()
        return Result(mode, index, acked, last - t0)
    finally:
        consumers.kill()
        await js.delete_stream(tag)


async def _wait_empty(bench: Bench, stream: str, within: float = 300.0) -> None:
    assert bench.js is not None
    deadline = time.monotonic() + within
    while (await bench.js.stream_info(stream)).state.messages > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"baseline stream {stream} not drained within {within}s")
        await asyncio.sleep(0.02)


# -- B: runfleet ------------------------------------------------------------------------------


async def runfleet_round(
    bench: Bench,
    mode: str,
    index: int,
    n: int,
    r: int,
    s: int,
    profile: tuple[str, Path] | None = None,
) -> Result:
    rnd = await bench.new_round(f"{mode}{index}")
    workflow = loaded(ONE_NODE)
    spies: list[subprocess.Popen[bytes]] = []
    try:
        if mode == "drain":
            await launch_many(rnd.publisher, workflow, n, concurrency=8)
            await rnd.publisher.flush()  # the backlog's records land before the drain starts
            procs = await rnd.start_runners(r, s)
            cpu0 = sum(p.cpu_seconds() for p in procs)
            io0 = sum(p.written_bytes() for p in procs)
            if profile is not None:
                spies = _start_spies(profile, procs)
            await rnd.wait_finished(n, within=max(120.0, n / 20))
            cpu = sum(p.cpu_seconds() for p in procs) - cpu0
            written = sum(p.written_bytes() for p in procs) - io0
            pulls = await asyncio.to_thread(per_pull, procs)
            await rnd.wait_events("run_finished", n)
            times = rnd.event_times("run_claimed", "run_finished")
            first = min(times["run_claimed"].values())
            last = max(times["run_finished"].values())
            skew = max(p.ready_at for p in procs) - min(p.ready_at for p in procs)
            if skew > 0.5:
                print(f"  (drain {index}: runners became ready {skew:.2f}s apart)")
            done = len(times["run_finished"])
            kib = written / done / 1024
            return Result(mode, index, done, last - first, cpu / done * 1e3, kib, per_pull=pulls)
        procs = await rnd.start_runners(r, s)
        await asyncio.sleep(0.5)
        cpu0 = sum(p.cpu_seconds() for p in procs)
        io0 = sum(p.written_bytes() for p in procs)
        if profile is not None:
            spies = _start_spies(profile, procs)
        t0, producer0 = time.time(), time.process_time()
        called: dict[str, float] = {}
        for _ in range(n):  # one awaited producer, each launch's call time kept
            at = time.time()
            doc = await rnd.publisher.launch(workflow, {}, tenant="default")
            called[doc.run_id] = at
        producer_cpu = time.process_time() - producer0
        await rnd.wait_finished(n, within=max(120.0, n / 20))
        cpu = sum(p.cpu_seconds() for p in procs) - cpu0
        written = sum(p.written_bytes() for p in procs) - io0
        pulls = await asyncio.to_thread(per_pull, procs)
        # The publication records still pending are the producer's work too (their read, and
        # the writes a claim did not make unneeded): counted, outside the timed window.
        flush0 = time.process_time()
        await rnd.publisher.flush()
        producer_cpu += time.process_time() - flush0
        await rnd.wait_events("run_finished", n)
        times = rnd.event_times("run_finished")
        done = len(times["run_finished"])
        seconds = max(times["run_finished"].values()) - t0
        kib = written / done / 1024
        waited = [(times["run_finished"][r] - at) * 1e3 for r, at in called.items()]
        latency = (percentile(waited, 50), percentile(waited, 99))
        runner_ms, producer_ms = cpu / done * 1e3, producer_cpu / n * 1e3
        return Result(mode, index, done, seconds, runner_ms, kib, producer_ms, pulls, latency)
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
        await bench.end_round(rnd)


def per_pull(procs: list[RunnerProc]) -> float:
    """Messages per delivering pull over the round, all runners (each runner is new)."""
    total = pulls = 0.0
    for p in procs:
        snap = p.metrics()
        total += metric(snap, "runfleet_fetch_messages_sum")
        pulls += metric(snap, "runfleet_fetch_messages_count")
    return total / pulls if pulls else float("nan")


def _start_spies(
    profile: tuple[str, Path], procs: list[RunnerProc]
) -> list[subprocess.Popen[bytes]]:
    binary, out_dir = profile
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                binary,
                "record",
                "--pid",
                str(p.pid),
                "--rate",
                "100",
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(out_dir / f"runner-{i}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, p in enumerate(procs)
    ]


# -- B: where the writes go -----------------------------------------------------------------


async def counting_pass(bench: Bench, n: int, slots: int) -> tuple[str, dict[str, float]]:
    """One in-process runner over a counting wrapper; the publisher on its own counted store."""
    from engine.config import EngineSettings
    from engine.sandbox.local import LocalSandboxDriver
    from publisher import Publisher
    from runner.config import RunnerSettings
    from runner.runner import Runner
    from store.blobs_fs import FilesystemBlobStore
    from store.sqlite import SqliteRunStore

    rnd = await bench.new_round("count")
    runner_store = CountingStore(await SqliteRunStore.open(rnd.db_path))
    pub_store = CountingStore(rnd.store)
    assert bench.nc is not None and bench.js is not None
    publisher = Publisher(
        store=pub_store,  # type: ignore[arg-type]
        nc=bench.nc,
        js=bench.js,
        settings=rnd.wire,
        names=rnd.names,
    )
    blobs = FilesystemBlobStore(rnd.dir / "blobs")
    lease = bench.lease
    engine = EngineSettings(
        lease_ttl=f"{lease.ttl}s",
        lease_interval=f"{lease.interval}s",
        lease_skew=f"{lease.skew}s",
        **({"lease_loss_margin": f"{lease.margin}s"} if lease.margin is not None else {}),
    )
    runner = Runner(
        store=runner_store,  # type: ignore[arg-type]
        driver=LocalSandboxDriver(rnd.dir / "data"),
        data_dir=rnd.dir / "data",
        blobs=blobs,
        settings=RunnerSettings(slots=slots, http_host="127.0.0.1", sweeper=False, backstop=False),
        engine=engine,
        wire=rnd.wire,
        owner="bench-counting",
    )
    try:
        t0 = time.perf_counter()
        await launch_many(publisher, loaded(ONE_NODE), n, concurrency=1)
        launch_s = time.perf_counter() - t0
        await runner.start()
        t0 = time.perf_counter()
        await rnd.wait_finished(n, within=max(120.0, n / 5), every=0.02)
        run_s = time.perf_counter() - t0
    finally:
        await runner.shutdown()
        await runner_store.close()
        await blobs.close()
        await bench.end_round(rnd)
    rows = []
    totals = {"writes": 0.0, "bytes": 0.0, "calls": 0.0}
    for side, store in (("publisher", pub_store), ("runner", runner_store)):
        for name, op in sorted(store.ops.items(), key=lambda kv: -kv[1].calls):
            if name == "close":
                continue
            kind = "write" if name in CountingStore.WRITES else "read"
            rows.append(
                (
                    side,
                    name,
                    kind,
                    op.calls / n,
                    op.bytes / n,
                    op.seconds / op.calls * 1e3 if op.calls else 0.0,
                )
            )
            totals["calls"] += op.calls / n
            if kind == "write":
                totals["writes"] += op.calls / n
                totals["bytes"] += op.bytes / n
    text = table(
        ["side", "store call", "kind", "per run", "bytes/run", "mean ms (awaited)"],
        rows,
    )
    text += (
        f"\nper run: {totals['writes']:.1f} writes, {totals['bytes']:,.0f} bytes stored,"
        f" {totals['calls']:.1f} store calls; in-process, one runner, {slots} slots:"
        f" launch {n / launch_s:,.0f} runs/s (one producer), execute {n / run_s:,.0f} runs/s"
        " (both slowed by the wrapper's own accounting)"
    )
    totals["launch_rate"] = n / launch_s
    totals["run_rate"] = n / run_s
    return text, totals


# -- main -------------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    ap.add_argument("--runners", type=int, default=2, help="R runner / consumer processes")
    ap.add_argument("--slots", type=int, default=16, help="S slots / tasks per process")
    ap.add_argument("--runs", type=int, default=5_000, help="B drain: runs per round")
    ap.add_argument("--e2e-runs", type=int, default=2_000, help="B e2e: runs per round")
    ap.add_argument("--msgs", type=int, default=100_000, help="A drain: messages per round")
    ap.add_argument("--e2e-msgs", type=int, default=10_000, help="A e2e: messages per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count-runs", type=int, default=500, help="runs in the counting pass")
    ap.add_argument("--modes", default="drain,e2e")
    ap.add_argument(
        "--py-spy", help="py-spy binary: profile B's runners in an extra round of the first mode"
    )
    ap.add_argument("--profile-dir", type=Path, default=Path("bench-profile"))
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, stores)")
    args = ap.parse_args()
    if args.quick:
        args.runners, args.slots, args.rounds = 1, 4, 1
        args.runs, args.e2e_runs, args.msgs, args.e2e_msgs = 100, 50, 2_000, 500
        args.count_runs = 20
    return args


async def main() -> int:
    args = parse()
    lease = QUICK_LEASE if args.quick else LeaseEnv()
    modes = [m for m in args.modes.split(",") if m]
    r, s = args.runners, args.slots
    print(f"throughput: {r} processes x {s} slots/tasks; {machine()}")
    results: dict[tuple[str, str], list[Result]] = {}
    async with Bench("throughput", lease=lease, keep=args.keep) as bench:
        if args.py_spy:  # an extra round of the first mode under the profiler, not counted
            mode = modes[0]
            n = args.runs if mode == "drain" else args.e2e_runs
            prof = await runfleet_round(bench, mode, 0, n, r, s, (args.py_spy, args.profile_dir))
            print(f"  profiled {mode}: B {prof.rate:,.0f} runs/s (py-spy attached; not counted)")
        for mode in modes:
            for i in range(1, args.rounds + 1):
                n_a = args.msgs if mode == "drain" else args.e2e_msgs
                a = await baseline_round(bench, mode, i, n_a, r, s)
                results.setdefault(("A", mode), []).append(a)
                print(f"  {mode} {i}: A {a.count} msgs in {a.seconds:.3f}s = {a.rate:,.0f}/s")
                n_b = args.runs if mode == "drain" else args.e2e_runs
                b = await runfleet_round(bench, mode, i, n_b, r, s)
                results.setdefault(("B", mode), []).append(b)
                print(
                    f"  {mode} {i}: B {b.count} runs in {b.seconds:.3f}s = {b.rate:,.0f}/s,"
                    f" runner CPU {b.cpu_ms_per_run:.2f} ms/run,"
                    f" runner disk writes {b.kib_per_run:.1f} KiB/run,"
                    f" {b.per_pull:.1f} msgs/pull"
                    + (
                        f", producer CPU {b.producer_cpu_ms:.2f} ms/launch,"
                        f" launch → finished p50 {b.latency_ms[0]:.1f} p99 {b.latency_ms[1]:.1f} ms"
                        if mode == "e2e"
                        else ""
                    )
                )
        count_text, totals = await counting_pass(bench, args.count_runs, s)

    rows = []
    summary = []
    for mode in modes:
        a_rates = [x.rate for x in results[("A", mode)]]
        b_rates = [x.rate for x in results[("B", mode)]]
        a_med, b_med = median(a_rates), median(b_rates)
        cpu = median([x.cpu_ms_per_run for x in results[("B", mode)]])
        kib = median([x.kib_per_run for x in results[("B", mode)]])
        rows.append(
            (
                mode,
                " / ".join(f"{x:,.0f}" for x in a_rates),
                a_med,
                " / ".join(f"{x:,.0f}" for x in b_rates),
                b_med,
                b_med / a_med,
                cpu,
                kib,
            )
        )
        waited = ""
        if mode == "e2e":
            p50 = median([x.latency_ms[0] for x in results[("B", mode)]])
            p99 = median([x.latency_ms[1] for x in results[("B", mode)]])
            waited = f" launch→finished p50={p50:.1f} p99={p99:.1f} ms"
        summary.append(
            f"{mode} A={a_med:,.0f} msgs/s B={b_med:,.0f} runs/s B/A={b_med / a_med:.3f}"
            f" ({cpu:.1f} runner-CPU ms/run){waited}"
        )
    print()
    print(
        table(
            [
                "mode",
                "A rounds (msgs/s)",
                "A median",
                "B rounds (runs/s)",
                "B median",
                "B/A",
                "B runner CPU ms/run",
                "B runner disk KiB/run",
            ],
            rows,
        )
    )
    print()
    print(count_text)
    print(
        "SUMMARY throughput: "
        + "; ".join(summary)
        + f"; B writes/run={totals['writes']:.1f} bytes/run={totals['bytes']:,.0f}"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--consumer-child":
        asyncio.run(consumer_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    else:
        run_main(main)
