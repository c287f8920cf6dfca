"""What every benchmark shares: a private nats-server and temp dir, per-round namespaces and
SQLite stores, `runfleet runner` subprocesses, reading times back from the store, /proc and
/metrics readers, a counting store wrapper, statistics and table printing.

Times of runfleet runs are read from the store (event `at`, epoch milliseconds written by the
runner processes), so they are what the fleet recorded, not what the benchmark's poller saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/x.py` as well as `python -m bench.x`
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.aio.client import Client  # noqa: E402
from nats.js import JetStreamContext  # noqa: E402

from engine.loader import LoadedWorkflow, load_workflow  # noqa: E402
from publisher import Publisher, WireNames, WireSettings, ensure_streams  # noqa: E402
from runner.localnats import NatsServer  # noqa: E402
from store.codec import encode  # noqa: E402
from store.sqlite import SqliteRunStore  # noqa: E402

RUNFLEET = Path(sys.executable).parent / "runfleet"
READY = re.compile(r"runner (?P<owner>\S+): (?P<slots>\d+) slots, http :(?P<port>\d+)")
CLK_TCK = os.sysconf("SC_CLK_TCK")

ONE_NODE = """\
name: bench_one
entry: a
nodes:
  a:
    kind: compute
    set:
      x: "1 + 1"
"""

SLEEP_NODE = """\
name: bench_sleep
entry: nap
vars:
  seconds:
    type: number
nodes:
  nap:
    kind: call
    function: bench.common:hold_for
    timeout: 86400
    inputs:
      seconds: "{{ vars.seconds }}"
"""


async def hold_for(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The benchmarks' long node: a call node that only awaits `asyncio.sleep(seconds)`."""
    seconds = float(inputs["seconds"])
    await asyncio.sleep(seconds)
    return {"slept": seconds}


# -- settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseEnv:
    """The lease settings a benchmark's runners and publisher use (SPEC §5.4)."""

    ttl: float = 30.0
    interval: float = 10.0
    skew: float = 2.0
    margin: float | None = None  # default TTL/6

    def env(self) -> dict[str, str]:
        out = {
            "RUNFLEET_LEASE_TTL": f"{self.ttl}s",
            "RUNFLEET_LEASE_INTERVAL": f"{self.interval}s",
            "RUNFLEET_LEASE_SKEW": f"{self.skew}s",
        }
        if self.margin is not None:
            out["RUNFLEET_LEASE_LOSS_MARGIN"] = f"{self.margin}s"
        return out


QUICK_LEASE = LeaseEnv(ttl=3.0, interval=1.0, skew=0.5, margin=0.5)


# -- runner processes -----------------------------------------------------------------------


@dataclass
class RunnerProc:
    proc: subprocess.Popen[bytes]
    log_path: Path
    owner: str = ""
    port: int = 0
    ready_at: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def cpu_seconds(self) -> float:
        """utime + stime of the process, from /proc/<pid>/stat."""
        return process_cpu_seconds(self.pid)

    def written_bytes(self) -> int:
        """Bytes this process sent to storage (`write_bytes` of /proc/<pid>/io): the SQLite
        WAL and checkpoints, the runner's log, nothing from sockets."""
        for line in Path(f"/proc/{self.pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
        return 0

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    async def stop(self, within: float = 15.0) -> None:
        """SIGTERM (drain), then SIGKILL if it has not exited in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.proc.wait, within)
        self.kill()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat's `cpu`
    line: busy is everything but idle and iowait, steal included (time the hypervisor gave
    elsewhere, ≈ 1.6 % of this VM's since boot when measured)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(values[:8])  # guest time is already counted in user
    idle = values[3] + values[4]
    return (total - idle) / CLK_TCK, total / CLK_TCK


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text format → {(name, labels): value}."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        labels: frozenset[tuple[str, str]] = frozenset()
        if "{" in name_labels:
            name, rest = name_labels.split("{", 1)
            pairs = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest)
            labels = frozenset(pairs)
        else:
            name = name_labels
        out[(name, labels)] = float(value)
    return out


def metric(
    snapshot: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return snapshot.get((name, frozenset(labels.items())), 0.0)


def histogram_bucket(
    q: float,
    after: dict[tuple[str, frozenset[tuple[str, str]]], float],
    before: dict[tuple[str, frozenset[tuple[str, str]]], float] | None,
    name: str,
) -> tuple[float, float] | None:
    """The bucket (lower, upper bound) the q-quantile falls in over the window."""
    buckets: list[tuple[float, float]] = []
    for (n, labels), value in after.items():
        if n == f"{name}_bucket":
            le = dict(labels)["le"]
            prev = before.get((n, labels), 0.0) if before else 0.0
            buckets.append((float("inf") if le == "+Inf" else float(le), value - prev))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    lower = 0.0
    for upper, count in buckets:
        if count >= q * buckets[-1][1]:
            return lower, upper
        lower = upper
    return lower, float("inf")


def histogram_quantile(
    q: float,
    after: dict[tuple[str, frozenset[tuple[str, str]]], float],
    before: dict[tuple[str, frozenset[tuple[str, str]]], float] | None,
    name: str,
) -> float | None:
    """Prometheus' `histogram_quantile` over the window between two snapshots (linear
    interpolation inside the bucket; the answer is only as fine as the buckets)."""
    buckets: list[tuple[float, float]] = []
    for (n, labels), value in after.items():
        if n != f"{name}_bucket":
            continue
        le = dict(labels)["le"]
        prev = before.get((n, labels), 0.0) if before else 0.0
        buckets.append((float("inf") if le == "+Inf" else float(le), value - prev))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower_bound
            span = count - lower_count
            frac = (rank - lower_count) / span if span > 0 else 1.0
            return lower_bound + (upper - lower_bound) * frac
        lower_bound, lower_count = upper, count
    return lower_bound


# -- the bench and its rounds ---------------------------------------------------------------


@dataclass
class Round:
    """One isolated measurement: its own stream namespace, SQLite file, data dir and runners."""

    dir: Path
    names: WireNames
    wire: WireSettings
    store: SqliteRunStore
    publisher: Publisher
    lease: LeaseEnv
    nats_url: str
    runners: list[RunnerProc] = field(default_factory=list)

    @property
    def db_path(self) -> Path:
        return self.dir / "runs.db"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            "RUNFLEET_DATA": str(self.dir / "data"),
            "RUNFLEET_NATS_URL": self.nats_url,
            "RUNFLEET_NAMESPACE": self.names.namespace,
            "RUNFLEET_STORE_URL": f"sqlite:///{self.db_path}",
            "RUNFLEET_BLOB_URL": f"file://{self.dir / 'blobs'}",
            "RUNFLEET_HTTP_HOST": "127.0.0.1",
            "RUNFLEET_HTTP_PORT": "0",
            **self.lease.env(),
            **(extra or {}),
        }

    def spawn_runner(self, slots: int, extra_env: dict[str, str] | None = None) -> RunnerProc:
        index = len(self.runners)
        log_path = self.dir / f"runner-{index}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [str(RUNFLEET), "runner", "--slots", str(slots)],
                env=self.env(extra_env),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        runner = RunnerProc(proc, log_path)
        self.runners.append(runner)
        return runner

    async def start_runners(
        self, count: int, slots: int, extra_env: dict[str, str] | None = None
    ) -> list[RunnerProc]:
        """Spawn `count` runner processes at once and wait until every one is consuming."""
        procs = [self.spawn_runner(slots, extra_env) for _ in range(count)]
        await asyncio.gather(*(wait_ready(p) for p in procs))
        return procs

    async def stop_runners(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.runners))
        self.runners.clear()

    async def finished_count(self) -> int:
        from store import RunStatus

        counts = await self.store.status_counts()
        return counts.get(RunStatus.FINISHED, 0)

    async def wait_finished(self, n: int, *, within: float, every: float = 0.1) -> None:
        deadline = time.monotonic() + within
        while True:
            done = await self.finished_count()
            if done >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {done}/{n} runs finished within {within}s")
            for r in self.runners:
                if not r.alive:
                    raise RuntimeError(f"runner {r.pid} exited {r.proc.returncode}:\n{r.log()}")
            await asyncio.sleep(every)

    async def wait_events(self, type_: str, n: int, within: float = 30.0) -> None:
        """Events are appended after the state they describe: a run can read `finished` a
        moment before its `run_finished` event lands."""
        deadline = time.monotonic() + within
        while len(self.event_times(type_)[type_]) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {n} {type_} events within {within}s")
            await asyncio.sleep(0.05)

    def event_times(self, *types: str) -> dict[str, dict[str, float]]:
        """{type: {run_id: first `at` of that type, epoch seconds}} read from the store file."""
        return event_times(self.db_path, types)


async def wait_ready(runner: RunnerProc, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while True:
        found = READY.search(runner.log())
        if found:
            runner.owner, runner.port = found["owner"], int(found["port"])
            runner.ready_at = time.time()
            return
        if not runner.alive:
            raise RuntimeError(f"runner exited {runner.proc.returncode}:\n{runner.log()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"runner not ready within {within}s:\n{runner.log()}")
        await asyncio.sleep(0.05)


def event_times(db: Path, types: Iterable[str]) -> dict[str, dict[str, float]]:
    wanted = list(types)
    out: dict[str, dict[str, float]] = {t: {} for t in wanted}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        marks = ",".join("?" * len(wanted))
        rows = conn.execute(
            "SELECT run_id, json_extract(doc, '$.type'), json_extract(doc, '$.at') FROM events"
            f" WHERE json_extract(doc, '$.type') IN ({marks}) ORDER BY run_id, seq",
            wanted,
        ).fetchall()
    finally:
        conn.close()
    for run_id, type_, at_ms in rows:
        out[type_].setdefault(run_id, at_ms / 1000.0)
    return out


class Bench:
    """The benchmark's private nats-server and temp dir; `new_round()` isolates each pass."""

    def __init__(self, name: str, *, lease: LeaseEnv, keep: bool = False) -> None:
        self.name = name
        self.lease = lease
        self.keep = keep
        self.tmp = Path(tempfile.mkdtemp(prefix=f"runfleet-bench-{name}-"))
        self.server = NatsServer(self.tmp / "nats")
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.rounds: list[Round] = []

    async def __aenter__(self) -> Bench:
        await asyncio.to_thread(self.server.start)
        self.nc = await nats.connect(self.server.url, max_reconnect_attempts=3)
        self.js = self.nc.jetstream()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for rnd in self.rounds:
            for r in rnd.runners:
                r.kill()
            with contextlib.suppress(Exception):
                await rnd.store.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        await asyncio.to_thread(self.server.stop)
        if self.keep:
            print(f"(kept {self.tmp})", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    async def new_round(self, label: str) -> Round:
        assert self.js is not None and self.nc is not None
        prefix = f"b{uuid.uuid4().hex[:12]}"
        rdir = self.tmp / f"{len(self.rounds):02d}-{label}"
        (rdir / "data").mkdir(parents=True)
        names = WireNames(prefix)
        wire = WireSettings(
            namespace=prefix,
            data=rdir / "data",
            nats_url=self.server.url,
            lease_ttl=f"{self.lease.ttl}s",
            lease_skew=f"{self.lease.skew}s",
        )
        await ensure_streams(self.js, names, wire)
        store = await SqliteRunStore.open(rdir / "runs.db")
        publisher = Publisher(store=store, nc=self.nc, js=self.js, settings=wire, names=names)
        rnd = Round(rdir, names, wire, store, publisher, self.lease, self.server.url)
        self.rounds.append(rnd)
        return rnd

    async def end_round(self, rnd: Round) -> None:
        await rnd.stop_runners()
        await rnd.publisher.flush()
        await rnd.store.close()
        assert self.js is not None
        for stream in (rnd.names.runs_stream, rnd.names.advisory_stream, rnd.names.dlq_stream):
            with contextlib.suppress(Exception):
                await self.js.delete_stream(stream)
        if not self.keep:
            shutil.rmtree(rnd.dir / "data", ignore_errors=True)


def loaded(source: str) -> LoadedWorkflow:
    return load_workflow(source, "bench.yaml")


async def launch_many(
    publisher: Publisher,
    workflow: LoadedWorkflow,
    n: int,
    inputs: dict[str, Any] | None = None,
    *,
    concurrency: int = 8,
) -> list[str]:
    """Launch `n` runs with `concurrency` launches in flight (launch is several store writes
    and an awaited publish; one at a time would make the backlog slow to build)."""
    ids: list[str] = []
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            doc = await publisher.launch(workflow, dict(inputs or {}), tenant="default")
            ids.append(doc.run_id)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(n, 1)))))
    return ids


# -- a counting store -----------------------------------------------------------------------


@dataclass
class OpStats:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


class CountingStore:
    """Wraps a `RunStore`: calls, awaited seconds and stored bytes per method. Bytes are the
    JSON of what the write stored (the whole run document for `update_run`/`create_run`: SQLite
    rewrites the row; the event for `append_event`)."""

    WRITES = frozenset(
        {
            "create_run",
            "update_run",
            "append_event",
            "put_interaction",
            "answer_interaction",
            "retire_interactions",
            "try_lock",
            "delete_run",
        }
    )

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ops: dict[str, OpStats] = defaultdict(OpStats)
        self.conflicts = 0

    def reset(self) -> None:
        self.ops = defaultdict(OpStats)
        self.conflicts = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                result = await attr(*args, **kwargs)
            finally:
                op = self.ops[name]
                op.calls += 1
                op.seconds += time.perf_counter() - started
            op.bytes += _stored_bytes(name, args, result, self)
            return result

        return counted


def _stored_bytes(name: str, args: Sequence[Any], result: Any, store: CountingStore) -> int:
    from store import CasConflict

    if name == "update_run":
        if isinstance(result, CasConflict):
            store.conflicts += 1
            return 0
        return len(json.dumps(encode(result), separators=(",", ":")))
    if name == "create_run":
        return len(json.dumps(encode(args[0]), separators=(",", ":")))
    if name == "append_event":
        return len(json.dumps(encode(result), separators=(",", ":")))
    return 0


# -- statistics and output ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in [0, 100])."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    return "\n".join([line, sep, *body])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} cpus, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f},"
        f" python {sys.version.split()[0]}"
    )


def run_main(main: Callable[[], Awaitable[int]]) -> None:
    """Run `main`; SIGINT or SIGTERM cancel it, so every `Bench` still cleans up (a script
    started in the background from a non-interactive shell ignores SIGINT)."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await main()

    try:
        code = asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        code = 130
    sys.exit(code)
