"""One soak's state and the fleet it runs: its own `nats-server` (`runner.localnats.NatsServer`,
or a local cluster) in a temporary directory, a SQLite store, filesystem blobs and the streams,
then N `runfleet runner` processes, started through the post-engine seam
(`tests/soak_seam.py`), watched until ready and restarted when they end (one that dies on its
own is a violation). `Fleet` is the base the other parts (`workload`, `faults`, `watch`,
`verdict`) build on: it holds the state they share and the few helpers they all use (`say`,
`eligible`, `until`, the fault windows).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from engine.loader import load_workflow
from publisher import DlqStore, Publisher, WireNames, WireSettings, ensure_streams
from publisher.connection import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S
from publisher.dlq import DlqRecord
from runner.localcluster import NatsCluster
from runner.localnats import NatsServer
from store.blobs_fs import FilesystemBlobStore
from store.sqlite import SqliteRunStore
from tests.soak.config import TENANT, TIMING, UNWIND_CEILING_S, SoakConfig, _jsonable
from tests.soak.report import Report
from tests.soak.workflow import WORKFLOW
from tests.soak_cluster import ClusterFaults
from tests.soak_seam import SEAM_ENV, PostEngineSeam
from tests.soak_soundings import DedupeCounter
from tests.support.nats_cluster import Cluster

READY = re.compile(r"runner (?P<owner>\S+): (?P<slots>\d+) slots, http :(?P<port>\d+)")
_LOOP_FAILED = re.compile(r"task (?P<loop>loop:\S+) failed: (?P<error>.*)")
_FRAME = re.compile(
    r'File "/\S*/(?P<file>(?:runner|engine|publisher|store)/\w+\.py)", line'
    r" (?P<line>\d+), in (?P<func>\w+)"
)

_NEXT_LOG_LINE = re.compile(r"\n(?=\d{4}-\d\d-\d\d |error \[)")
REPO = Path(__file__).resolve().parents[2]


# -- the fleet's processes ---------------------------------------------------------------------


@dataclass
class RunnerProc:
    index: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    spawned_at: float
    owner: str = ""
    port: int = 0
    ready: bool = False
    expected_exit: str = ""
    """Set before we signal it: `killed` or `drained`."""
    ended: str = ""
    ended_at: float = 0.0

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def cause(self) -> str:
        """Why the process ended, from its log: the first crashed loop (with the innermost
        runfleet frame of its traceback), or the CLI's last error line."""
        text = self.log()
        crashed = _LOOP_FAILED.search(text)
        if crashed:
            traceback = _NEXT_LOG_LINE.split(text[crashed.end() :], maxsplit=1)[0]
            frames = _FRAME.findall(traceback)  # the last is the innermost of the last exception
            where = f" at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
            return f"task {crashed['loop']} failed: {crashed['error']}{where}"
        errors = [line for line in text.splitlines() if line.startswith("error [")]
        return errors[-1] if errors else "(no cause in the log)"


@dataclass
class Window:
    kind: str
    start: float
    end: float = float("inf")


@dataclass
class Drain:
    owner: str
    outage: bool
    held: dict[str, int]
    """run id -> the attempt it held at SIGTERM (runs at the `work` node)."""
    tokens: dict[str, str]
    sent_at: float
    exit_code: int | None = None
    took_s: float = 0.0


class Fleet:
    """One soak's state, and its fleet's processes."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.own_tmp = cfg.data is None
        self.root = Path(cfg.data or tempfile.mkdtemp(prefix="runfleet-soak-")).resolve()
        self.data = self.root / "data"
        self.db = self.root / "runs.db"
        self.ledger = self.root / "ledger"
        self.done = self.root / "completions"
        self.logs = self.root / "logs"
        self.names = WireNames(f"soak{uuid.uuid4().hex[:8]}")
        self.server: NatsServer | NatsCluster = (
            Cluster(self.root / "nats", cfg.nats_cluster)
            if cfg.nats_cluster > 1
            else NatsServer(self.root / "nats")
        )
        self.loaded = load_workflow(WORKFLOW, "soak.yaml")
        self.workflow_file = self.root / "soak.yaml"
        self.seed_file = self.root / "seed.txt"
        self.started = time.monotonic()
        self.stop = asyncio.Event()
        self.chaos_done = asyncio.Event()
        self.progressed = asyncio.Event()
        self.nats_down = False
        self.report = Report(config=_jsonable(dataclasses.asdict(cfg)))
        self.runners: list[RunnerProc] = []
        self.history: list[RunnerProc] = []
        self.protected: set[int] = set()
        self.pending_respawn: set[int] = set()
        self.launched: list[str] = []
        self.refused: list[str] = []
        self.finished = 0
        """Soak runs in `finished` (a cheap count; the verdict reads every run at the end)."""
        self.parked: dict[str, list[tuple[int, int]]] = defaultdict(list)
        """run id -> [(attempt, DLQ record id)] parked by a spent delivery budget, replayed."""
        self.interrupted = False
        self.resuming: set[str] = set()
        self.windows: list[Window] = []
        self.drain_log: list[Drain] = []
        self.poison: dict[int, str] = {}
        self.seam = PostEngineSeam(self.root / "seam")
        self.caught: list[str] = []
        """Run ids whose `finished` status write a post-engine store fault caught."""
        self.dlq_seen: dict[int, tuple[float, DlqRecord]] = {}
        """Every DLQ record the soak saw standing: id -> (first seen, record)."""
        self.dlq_behind: set[int] = set()
        self.orphans: dict[str, float] = {}
        self.events: dict[str, list[Any]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.store: SqliteRunStore | None = None
        self.reader: SqliteRunStore | None = None
        self.blobs: FilesystemBlobStore | None = None
        self.publisher: Publisher | None = None
        self.dlq: DlqStore | None = None
        self.faults: ClusterFaults | None = None
        self.dedupe = DedupeCounter()

    # -- setup and teardown ----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "RUNFLEET_DATA": str(self.data),
            "RUNFLEET_NATS_URL": self.server.url,
            "RUNFLEET_NAMESPACE": self.names.namespace,
            "RUNFLEET_STORE_URL": f"sqlite:///{self.db}",
            "RUNFLEET_BLOB_URL": f"file://{self.root / 'blobs'}",
            "RUNFLEET_TENANT": TENANT,
            "RUNFLEET_HTTP_HOST": "127.0.0.1",
            "RUNFLEET_HTTP_PORT": "0",
            "PYTHONUNBUFFERED": "1",
            SEAM_ENV: str(self.seam.directory),
            **{f"RUNFLEET_{k}": v for k, v in TIMING.items()},
        }
        if not self.cfg.sweeper:
            env["RUNFLEET_SWEEPER"] = "false"
        if self.cfg.nats_cluster > 1:
            env["RUNFLEET_STREAM_REPLICAS"] = str(self.cfg.nats_cluster)
        return env

    def wire(self) -> WireSettings:
        return WireSettings(
            namespace=self.names.namespace,
            data=self.data,
            nats_url=self.server.url,
            lease_ttl=TIMING["LEASE_TTL"],
            lease_skew=TIMING["LEASE_SKEW"],
            max_deliver=int(TIMING["MAX_DELIVER"]),
            duplicate_window=TIMING["DUPLICATE_WINDOW"],
            sweeper_interval=TIMING["SWEEPER_INTERVAL"],
            sweeper_grace=TIMING["SWEEPER_GRACE"],
            publish_attempts=int(TIMING["PUBLISH_ATTEMPTS"]),
            publish_retry_budget=TIMING["PUBLISH_RETRY_BUDGET"],
            publish_timeout=TIMING["PUBLISH_TIMEOUT"],
            stream_replicas=self.cfg.nats_cluster,
        )

    async def start(self) -> None:
        for path in (self.data, self.logs):
            path.mkdir(parents=True, exist_ok=True)
        self.workflow_file.write_text(WORKFLOW)
        self.seed_file.write_text("the soak's attachment\n")
        await asyncio.to_thread(self.server.start)
        self.dedupe.install()
        wire = self.wire()
        self.nc = await nats.connect(
            servers=self.server.url.split(","),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            # The product's pings (`publisher.connection`): a paused server is given up alike.
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=_quiet,  # the outage is on purpose: no traceback per reconnect try
        )
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.names, wire)
        self.store = await SqliteRunStore.open(self.db)
        self.reader = await SqliteRunStore.open(self.db)
        self.blobs = FilesystemBlobStore(self.root / "blobs")
        self.dlq = DlqStore(self.js, self.names, self.blobs)
        self.publisher = Publisher(
            store=self.store, nc=self.nc, js=self.js, settings=wire, names=self.names, dlq=self.dlq
        )
        for i in range(self.cfg.runners):
            self.runners.append(self.spawn(i))
        await self.wait_ready(self.runners, within=60)

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for rp in self.runners:
            if rp.proc.poll() is None:
                rp.proc.send_signal(signal.SIGTERM)
        for rp in self.runners:
            try:
                await asyncio.to_thread(rp.proc.wait, UNWIND_CEILING_S + 10)
            except subprocess.TimeoutExpired:
                rp.proc.kill()
                rp.proc.wait()
        for rp in self.history:
            if rp.proc.poll() is None:
                rp.proc.kill()
            rp.proc.wait()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        for closable in (self.store, self.reader, self.blobs):
            if closable is not None:
                await closable.close()
        await asyncio.to_thread(self.server.stop)
        self.dedupe.remove()

    def spawn(self, index: int) -> RunnerProc:
        log_path = self.logs / f"runner-{index}-{len(self.history)}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                # `runfleet runner` with the post-engine seam (`tests/soak_seam.py`).
                [sys.executable, "-m", "tests.soak_seam", "runner", "--slots", str(self.cfg.slots)],
                env=self.env(),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C on the soak is not a drain of its runners
            )
        rp = RunnerProc(index, proc, log_path, time.monotonic())
        self.history.append(rp)
        return rp

    async def wait_ready(self, procs: list[RunnerProc], within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            pending = [rp for rp in procs if not self.check_ready(rp)]
            if not pending:
                return
            for rp in pending:
                if rp.proc.poll() is not None:
                    raise RuntimeError(f"runner exited {rp.proc.returncode}:\n{rp.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"runner not ready within {within}s:\n{pending[0].tail()}")
            await asyncio.sleep(0.1)

    def check_ready(self, rp: RunnerProc) -> bool:
        if not rp.ready:
            found = READY.search(rp.log())
            if found:
                rp.owner, rp.port, rp.ready = found["owner"], int(found["port"]), True
        return rp.ready

    def respawn(self, index: int) -> None:
        """Start a new process in slot `index` now, or as soon as NATS is back (a runner that
        cannot reach NATS at start exits 4, by design)."""
        if self.nats_down:
            self.pending_respawn.add(index)
            return
        self.pending_respawn.discard(index)
        self.runners[index] = self.spawn(index)
        self.report.restarts += 1

    def say(self, text: str) -> None:
        if not self.cfg.quiet:
            print(f"[soak {time.monotonic() - self.started:7.1f}s] {text}", file=sys.stderr)

    # -- the runners, and what every part of the soak shares -------------------------------------

    def eligible(self) -> list[RunnerProc]:
        return [
            rp
            for rp in self.runners
            # `expected_exit` is set just before a signal is sent: a runner SIGKILLed a moment
            # ago may not be reaped yet (`poll()` still None), and must not be drained.
            if rp.ready
            and not rp.expected_exit
            and rp.proc.poll() is None
            and rp.index not in self.protected
        ]

    def mark_ended(self, rp: RunnerProc, how: str) -> None:
        if not rp.ended:
            rp.ended, rp.ended_at = how, time.time()

    async def supervisor(self) -> None:
        """Notice runners that die on their own (a crash is a violation) and restart them."""
        while not self.stop.is_set():
            for index in sorted(self.pending_respawn):
                self.respawn(index)
            for rp in list(self.runners):
                self.check_ready(rp)
                code = rp.proc.poll()
                if code is None or rp.expected_exit or rp.index in self.protected:
                    continue
                if code == 4 and not rp.ready and self.start_refused_by_nats():
                    # Started just as NATS went away (or, on a cluster, while the consumer had
                    # no leader and its info request timed out): "infrastructure unreachable"
                    # (exit 4) is the CLI's answer, not a crash.
                    rp.expected_exit = "unreachable"
                    self.say(f"runner {rp.index} could not reach NATS at start; restarting")
                else:
                    rp.expected_exit = "crashed"
                    self.mark_ended(rp, "crashed")
                    self.report.crashes += 1
                    self.report.violations.append(
                        f"runner {rp.index} ({rp.owner or rp.proc.pid}) exited {code} on its"
                        f" own: {rp.cause()} (log {rp.log_path})"
                    )
                    self.say(f"runner {rp.index} crashed (exit {code}); restarting")
                self.respawn(rp.index)
            await asyncio.sleep(0.2)

    def finished_at_least(self, count: int) -> bool:
        return self.finished >= count

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition` holds; re-judged whenever a run is launched or finishes."""
        while not condition():
            self.progressed.clear()
            await self.progressed.wait()

    def start_refused_by_nats(self) -> bool:
        """Around a NATS outage, or a cluster fault plus the 5 s a runner's start-up request
        waits for an answer (with the slack of this loop's polling)."""
        return self.in_window("nats", slack=5.0) or self.in_window("cluster", slack=10.0)

    def in_window(self, kind: str, slack: float) -> bool:
        now = time.monotonic()
        return any(w.kind == kind and w.start - slack <= now <= w.end + slack for w in self.windows)

    def last_fault_end(self) -> float:
        ends = [w.end for w in self.windows if w.end != float("inf")]
        return max(ends, default=0.0)


async def _quiet(exc: Exception) -> None:
    return None
