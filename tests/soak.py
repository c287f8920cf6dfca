"""The chaos soak: many runs through a real fleet while it is being broken on purpose.

    python -m tests.soak --runs 300 --runners 3 --kill-every 5 --seed 7 [--data DIR] [--keep]

(`--help` lists the options; every fault is on by default.)

It starts its own `nats-server` (`runner.localnats.NatsServer`) in a temporary directory, a SQLite
store, filesystem blobs and the streams, with short leases (TTL 3 s) and a fast sweeper (1 s
interval, 3 s grace), then N `runfleet runner` processes. It launches K runs of one workflow:

    prepare (tool) -> flaky (tool, exits 75 on its first try per run) -> approve (human)
        -> work (tool, sleeps 1-3 s) -> finish (tool, writes the completion ledger)

Every tool node appends one line per execution to a ledger (time, run id, node, execution
token — the lease token, mapped to its attempt through the `run_claimed` events). While the runs
flow, the soak answers the human pauses (the publisher's resume, every 10th through `runfleet
resume`), and breaks things:

- SIGKILL: a random runner every `--kill-every` s (jittered), restarted at once. Saved by the
  lease's expiry, the redelivery after `ack_wait`, and the adoption (SPEC §5.3, §5.4).
- drain: SIGTERM to the runner holding most runs mid-`work`, NATS up. Saved by the handoff
  (§5.6): `RUNNER_INTERRUPTED`, attempt + 1, a fresh publication; the runner exits 0.
- NATS outage: `nats-server` stopped and started again on the same port; while it is down a
  runner holding runs is SIGTERMed, so its handoff publishes fail. Saved by the orphan sweeper
  (§5.9), which republishes the handed-off attempts.
- (`--nats-cluster 3`) a three-node JetStream cluster (`runner.localcluster`) with every stream
  at three replicas, `--leader-kills` SIGKILLs of the node leading the runs stream, each
  restarted after `--leader-outage-s`, and `--server-faults` more in turn (`tests/soak_cluster.py`:
  SIGKILL of a random node, of the consumer's leader, stream and consumer leader step-downs
  through the JetStream API, the consumer's leader SIGSTOPped past `ack_wait`). Saved by the
  client's reconnect to another server, the new leader (and the stream's dedupe window), and the
  consumer's replicated state.
- store fault: a separate sqlite3 connection holds `BEGIN EXCLUSIVE` longer than the busy
  timeout, so every write of every process gets SQLITE_BUSY (`StoreUnavailable`); reads go on
  (WAL). Saved by the transient nak, lease loss and fencing (§5.1, §5.4, §5.6).
- post-engine store fault: the same lock, taken at the instant a run's last node is done and
  its `finished` status write goes (timed by the one seam in the runner processes,
  `tests/soak_seam.py`), held past two busy timeouts, so the store refuses that status write.
  Saved by the nak with no DLQ record, teardown and release still attempted, and the adoption
  that finds the last checkpoint written (§5.1, §5.6 v2.2; ADR-0010).
- poison: garbage on the work subject (bytes, wrong JSON, lost runs, another tenant's message
  for a real run) and hostile bodies (`tests/soak_hostile.py`: 5 000-digit integers, 200 000
  nested arrays, a 1 MB string, wrong types at each field, a lying 5 000-digit attempt header).
  Saved by admission's DLQ path (§5.2 steps 1-2): each one a `malformed` record.

Acting as the operator, it also replays from the DLQ a run parked `DLQ_PARKED` because chaos
spent its whole delivery budget (10 deliveries, each to an execution that got interrupted).

At the end (or at `--deadline`, or on SIGINT/SIGTERM) it checks, and exits 1 on any violation:
every run `finished`, its checkpoint holding its four tool nodes and the answer it was given; one
`run_finished` event per run and a completion-ledger line; every ledger line of a node beyond
the first comes from an execution that was interrupted while it ran the node — its runner was
killed, drained or crashed soon after, its lease was lost, or a store/NATS fault window was
around it — and never from an execution that had recorded `node_finished` for it (SPEC §13.6);
every execution of a run that spent its delivery budget was interrupted the same way; no run
stayed `queued`/`running`/auto-resumable with no lease and no message longer than the
sweeper's interval plus grace (+ slack, SPEC §13.5); no live lease is left at the end; the DLQ
holds exactly the deliberate poison, each with its reason; no record ever stood for a real run
unless the soak dead-lettered it (a spent delivery budget's park, replayed, or such a park's
record withdrawn excepted), none names a store error, and no run stood `queued`/`running`
behind one; no runner died on its own; every drain exited 0 within the unwind ceiling and
handed off the runs it held mid-node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from engine.attachments import AttachmentLimits, promote_for_launch
from engine.loader import load_workflow
from engine.local import new_run_id
from engine.resume import ResumeRequest
from publisher import DlqStore, Publisher, WireNames, WireSettings, ensure_streams
from publisher.connection import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S
from publisher.dlq import DlqRecord
from publisher.wire import RunMessage, encode
from runner.localcluster import NatsCluster
from runner.localnats import NatsServer
from store import RunDocument, RunfleetError, RunQuery, RunStatus, StoreError, utcnow
from store.blobs_fs import FilesystemBlobStore
from store.sqlite import SqliteRunStore
from store.staging import StagingStore
from tests.soak_cluster import KINDS, ClusterFaults
from tests.soak_hostile import hostile_bodies
from tests.soak_seam import SEAM_ENV, PostEngineSeam
from tests.soak_soundings import DedupeCounter, count_dedupe_answers, count_redeliveries
from tests.support.nats_cluster import Cluster

TENANT = "default"
NODES = ("prepare", "flaky", "approve", "work", "finish")
LEDGER_NODES = ("prepare", "flaky", "work", "finish")
COMPLETED = LEDGER_NODES
"""A finished run's `checkpoint.completed`: the executed nodes (an answered human node is
recorded as its output, not as a completed node)."""
READY = re.compile(r"runner (?P<owner>\S+): (?P<slots>\d+) slots, http :(?P<port>\d+)")
_LOOP_FAILED = re.compile(r"task (?P<loop>loop:\S+) failed: (?P<error>.*)")
_FRAME = re.compile(
    r'File "/\S*/(?P<file>(?:runner|engine|publisher|store)/\w+\.py)", line'
    r" (?P<line>\d+), in (?P<func>\w+)"
)

_NEXT_LOG_LINE = re.compile(r"\n(?=\d{4}-\d\d-\d\d |error \[)")
_STATUS_REFUSED = re.compile(r"run (?P<run>\S+): status not written \((?P<error>\w+)")
_STORE_ERROR = re.compile(r"Store\w*Error|StoreUnavailable|store_un\w+|database is locked")
REPO = Path(__file__).resolve().parents[1]

KNOWN_FINDINGS = {
    "F1": re.compile(r"task loop:backstop failed: ServerError\(\).* in _delete"),
    "F2": re.compile(r"task loop:backstop failed: (ServiceUnavailableError|TimeoutError)\(\)"),
    "F3": re.compile(r"task loop:sweeper failed: TimeoutError\(\)"),
    "F4": re.compile(r"is finished but has no run_finished event"),
}
"""The product findings of this soak (docs/reliability.md, "Findings"), by the cause a violation
names, all fixed in commit 36fa8db: F1 the backstop died deleting a message already gone; F2 the
backstop loop died on a NATS error while the server restarted (a 503 on its fetch, a JetStream
call timing out); F3 the sweeper loop died on a JetStream call timing out while the server was
down (each of F1-F3 ended the runner process with exit 1); F4 a runner killed between a settled
status and its event left the event missing for good. A violation that matches one is that
finding come back."""


def known_finding(violation: str) -> str | None:
    return next((name for name, sig in KNOWN_FINDINGS.items() if sig.search(violation)), None)


# Short timings (the runner tests' values): ack_wait = TTL + skew = 3.5 s; the unwind ceiling
# is 5 + 1 + 10 + 5 + 1 = 22 s. The sweeper passes every second and republishes after 3 s.
TIMING = {
    "LEASE_TTL": "3s",
    "LEASE_INTERVAL": "1s",
    "LEASE_SKEW": "0.5s",
    "LEASE_LOSS_MARGIN": "0.5s",
    "NODE_CANCEL_BUDGET": "5s",
    "TEARDOWN_BUDGET": "10s",
    "SCRATCH_BANK_BUDGET": "5s",
    "POST_ENGINE_BUDGET": "5s",
    "UNWIND_MARGIN": "1s",
    "SWEEPER_INTERVAL": "1s",
    "SWEEPER_GRACE": "3s",
    "DUPLICATE_WINDOW": "30s",
    "PUBLISH_ATTEMPTS": "2",
    "PUBLISH_RETRY_BUDGET": "2s",
    "PUBLISH_TIMEOUT": "1s",
    "TRANSIENT_DELAY": "1s",
    "MAX_DELIVER": "10",
}
ACK_WAIT_S = 3.5
UNWIND_CEILING_S = 22.0
SWEEPER_INTERVAL_S = 1.0
SWEEPER_GRACE_S = 3.0
SQLITE_BUSY_TIMEOUT_S = 10.0
POST_ENGINE_FAULT_S = 2 * SQLITE_BUSY_TIMEOUT_S + 2.0
"""Past two busy timeouts: a runner's store thread takes its writes in batches, and the caught
status write may be queued behind a batch that began just before it (a lease refresh); that
batch fails at one busy timeout, the status write's batch at two."""
POST_ENGINE_CATCH_S = 60.0
"""How long an armed post-engine fault waits for a `finished` status write to catch."""

# `$RUNFLEET_WORKSPACE` is `<data>/work/<run_id>/<lease token>`: the line names the run and the
# execution without any help from the workflow's vars.
_LINE = (
    'W="$RUNFLEET_WORKSPACE"; echo "$(date +%s.%N) $(basename "$(dirname "$W")") {node}'
    ' $(basename "$W")" >> {target}'
)
WORKFLOW = f"""\
# The soak's workflow: every tool node appends one line per execution to a ledger.
name: soak
entry: prepare
vars:
  ledger:
    type: string
  done:
    type: string
  work_s:
    type: number
    default: 1
nodes:
  prepare:
    kind: tool
    # The run's attachment must be readable here, wherever a kill moved the run (SPEC §13.11).
    run: {
    json.dumps(
        "test -s {{ attachments.seed.path }} && "
        + _LINE.format(node="prepare", target="{{ vars.ledger }}")
    )
}
  flaky:
    kind: tool
    retry:
      max: 0
    run: {
    json.dumps(
        'if [ ! -f "$RUNFLEET_SCRATCH_DIR/flaky.marker" ]; then'
        ' touch "$RUNFLEET_SCRATCH_DIR/flaky.marker"; exit 75; fi; '
        + _LINE.format(node="flaky", target="{{ vars.ledger }}")
    )
}
  approve:
    kind: human
    questions:
      - name: approved
        type: bool
  work:
    kind: tool
    timeout: 120s
    run: {
    json.dumps(_LINE.format(node="work", target="{{ vars.ledger }}") + "; sleep {{ vars.work_s }}")
}
  finish:
    kind: tool
    run: {
    json.dumps(
        _LINE.format(node="finish", target="{{ vars.ledger }}")
        + "; "
        + _LINE.format(node="finish", target="{{ vars.done }}")
    )
}
edges:
  - from: prepare
    to: flaky
  - from: flaky
    to: approve
  - from: approve
    to: work
    when: answers.approved
  - from: work
    to: finish
"""


@dataclass
class SoakConfig:
    runs: int = 300
    runners: int = 3
    slots: int = 4
    kill_every: float = 5.0
    seed: int = 1
    data: Path | None = None
    keep: bool = False
    max_kills: int | None = None
    """Stop killing after this many SIGKILLs (None: keep killing until the runs are done)."""
    concurrency: int = 24
    """Runs launched and not yet finished, at most."""
    drains: int = 1
    nats_restarts: int = 1
    nats_outage_s: float = 8.0
    """How long nats-server stays down (a pod rescheduled takes longer than a restart)."""
    store_faults: int = 1
    store_fault_s: float = 12.0
    post_engine_store_faults: int = 1
    post_engine_store_fault_s: float = POST_ENGINE_FAULT_S
    """A store outage opened on a caught `finished` status write (`tests/soak_seam.py`)."""
    poison_per_batch: int = 4
    hostile_poison: bool = True
    """Send `tests/soak_hostile.py`'s bodies with every poison batch."""
    cli_resume_every: int = 10
    deadline_s: float | None = None
    """Whole-soak deadline; default 600 s + 3 s per run."""
    quiet: bool = False
    sweeper: bool = True
    """`False` runs the runners with `RUNFLEET_SWEEPER=false` (to show the soak catches it)."""
    nats_cluster: int = 1
    """Above 1: a local JetStream cluster of that many servers, streams at that many replicas."""
    leader_kills: int = 1
    """With a cluster: SIGKILLs of the runs stream's leader (each restarted)."""
    leader_outage_s: float = 5.0
    server_faults: int = 0
    """With a cluster: faults of `tests.soak_cluster.KINDS`, in turn (each restarted)."""
    pause_s: float = 12.0
    """How long a paused node stays SIGSTOPped: past `ack_wait` (3.5 s) and past raft's election
    timeout (3.5-7 s measured), so the others elect a leader while it sleeps."""

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else 600.0 + 3.0 * self.runs


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


@dataclass
class Report:
    config: dict[str, Any]
    runs: int = 0
    finished: int = 0
    launch_refused: int = 0
    kills: int = 0
    restarts: int = 0
    crashes: int = 0
    nats_restarts: int = 0
    leader_kills: int = 0
    max_leaderless_s: float = 0.0
    """The longest a server fault left the runs stream or its consumer with no live leader:
    the longest a run waited for a live broker (no publish, ack or delivery could land)."""
    server_faults: Counter[str] = field(default_factory=Counter)
    """Cluster faults by kind (`tests.soak_cluster.KINDS`), stream-leader kills included."""
    dedupe_answered: int = 0
    """Publications answered `duplicate` by the stream's dedupe window (every process's log)."""
    redeliveries: int = 0
    """Deliveries beyond a message's first (the delivery log; a lower bound, fire-and-forget)."""
    store_fault_windows: int = 0
    post_engine_windows: int = 0
    post_engine_refused: int = 0
    """Caught `finished` status writes the store refused (`status not written`, then a nak)."""
    status_refused: int = 0
    """Every status write the store refused, caught or not."""
    drains: int = 0
    handoffs: int = 0
    drain_held: list[tuple[bool, int]] = field(default_factory=list)
    """Per drain: (during the NATS outage, runs it held mid-`work` at SIGTERM)."""
    orphans_repaired: int = 0
    stale_leases: int = 0
    missing_events: int = 0
    max_orphan_s: float = 0.0
    rerun_nodes: int = 0
    rerun_causes: Counter[str] = field(default_factory=Counter)
    transient_retries: int = 0
    resumes: int = 0
    resumes_cli: int = 0
    resume_retries: int = 0
    replays: int = 0
    """Runs parked by a spent delivery budget and replayed from the DLQ (the operator's move)."""
    interrupted: bool = False
    lost: int = 0
    duplicated: int = 0
    stuck: int = 0
    dlq_records: int = 0
    poison: int = 0
    hostile: int = 0
    dlq_chaos: int = 0
    """Records of runs parked by a spent delivery budget (and replayed), seen while they stood."""
    dlq_withdrawn: int = 0
    """Records seen, then gone without a replay: a last delivery's park that did not land."""
    wall_s: float = 0.0
    data_dir: str = ""
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def table(self) -> str:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(self.rerun_causes.items())) or "-"
        rows = [
            ("runs", str(self.runs)),
            ("finished", str(self.finished)),
            ("launch refused (caller told)", str(self.launch_refused)),
            ("runner SIGKILLs", str(self.kills)),
            ("runner restarts", str(self.restarts)),
            ("runner crashes (unexpected exits)", str(self.crashes)),
            ("nats restarts", str(self.nats_restarts)),
            (
                "nats server faults (cluster; " + "/".join(KINDS) + ")",
                f"{sum(self.server_faults.values())} ("
                + "/".join(str(self.server_faults[k]) for k in KINDS)
                + ")",
            ),
            ("nats stream-leader SIGKILLs (cluster)", str(self.leader_kills)),
            (
                "longest a run waited for a live broker (no leader)",
                f"{self.max_leaderless_s:.1f}s",
            ),
            ("duplicate publications answered by dedupe", str(self.dedupe_answered)),
            ("redeliveries (delivery log)", str(self.redeliveries)),
            ("store-fault windows", str(self.store_fault_windows)),
            (
                "post-engine store faults (status writes refused)",
                f"{self.post_engine_windows} ({self.post_engine_refused})",
            ),
            ("status writes refused by the store (all)", str(self.status_refused)),
            ("drains (SIGTERM)", str(self.drains)),
            ("handoffs published", str(self.handoffs)),
            ("orphans repaired (max age)", f"{self.orphans_repaired} ({self.max_orphan_s:.1f}s)"),
            ("expired leases left on settled runs", str(self.stale_leases)),
            ("finished runs missing `run_finished`", str(self.missing_events)),
            ("transient first-try failures", str(self.transient_retries)),
            (
                "resumes (via CLI) / retried",
                f"{self.resumes} ({self.resumes_cli}) / {self.resume_retries}",
            ),
            ("re-run nodes (at-least-once)", f"{self.rerun_nodes} ({causes})"),
            ("budget-spent runs replayed from the DLQ", str(self.replays)),
            ("lost", str(self.lost)),
            ("duplicated", str(self.duplicated)),
            ("stuck", str(self.stuck)),
            (
                "DLQ records (deliberate poison, of it hostile)",
                f"{self.dlq_records} ({self.poison}, {self.hostile})",
            ),
            (
                "chaos DLQ records seen: replayed / withdrawn",
                f"{self.dlq_chaos} / {self.dlq_withdrawn}",
            ),
            ("wall time", f"{self.wall_s:.1f}s"),
            ("violations", str(len(self.violations))),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)


# -- the soak ----------------------------------------------------------------------------------


class Soak:
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

    # -- driving ---------------------------------------------------------------------------------

    async def drive(self) -> None:
        loops: list[Callable[[], Coroutine[Any, Any, None]]] = [
            self.launcher,
            self.resumer,
            self.killer,
            self.chaos,
            self.supervisor,
            self.monitor,
            self.dlq_watch,
            self.progress,
        ]
        self.tasks = [asyncio.create_task(loop(), name=loop.__name__) for loop in loops]
        deadline = self.started + self.cfg.deadline
        while time.monotonic() < deadline:
            for task in self.tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"soak loop {task.get_name()} failed") from task.exception()
            if self.all_done() or self.interrupted:
                break
            await asyncio.sleep(0.5)
        else:
            self.say(f"deadline of {self.cfg.deadline:.0f}s reached")
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def all_done(self) -> bool:
        return len(self.launched) >= self.cfg.runs and self.finished >= len(self.launched)

    async def launcher(self) -> None:
        assert self.publisher is not None
        hold = min(max(2, self.cfg.concurrency // 2), max(self.cfg.runs // 4, 1))
        while len(self.launched) < self.cfg.runs:
            inflight = len(self.launched) - self.finished
            tail = len(self.launched) >= self.cfg.runs - hold and not self.chaos_done.is_set()
            if inflight >= self.cfg.concurrency or tail or self.nats_down:
                await asyncio.sleep(0.1)
                continue
            run_id = new_run_id()
            inputs = {
                "ledger": str(self.ledger),
                "done": str(self.done),
                "work_s": round(self.rng.uniform(1.0, 3.0), 2),
            }
            try:
                assert self.blobs is not None
                files = await promote_for_launch(
                    StagingStore(self.publisher.store, self.blobs),
                    self.blobs,
                    TENANT,
                    run_id,
                    paths={"seed": self.seed_file},
                    uploads={},
                    limits=AttachmentLimits(),
                )
                await self.publisher.launch(
                    self.loaded, inputs, tenant=TENANT, run_id=run_id, attachments=files
                )
            except (RunfleetError, OSError) as exc:
                # The caller was told. A launch whose publish failed ends `failed
                # LAUNCH_FAILED` (SPEC §4): not a run to finish, launch another. A run that
                # exists otherwise (e.g. the error came after the create) must still finish.
                self.say(f"launch of {run_id} raised: {exc!r}")
                await asyncio.sleep(0.5)
                with contextlib.suppress(RunfleetError):
                    doc = await self.publisher.store.get_run(run_id)
                    if doc.failure_code == "LAUNCH_FAILED":
                        self.refused.append(run_id)
                    else:
                        self.launched.append(run_id)
                        self.progressed.set()
                continue
            self.launched.append(run_id)
            self.progressed.set()

    async def resumer(self) -> None:
        assert self.reader is not None
        count = 0
        while not self.stop.is_set():
            try:
                counts = await self.reader.status_counts(TENANT)
                paused = await _list(self.reader, [RunStatus.PAUSED_WAITING_HUMAN])
                failed = await _list(self.reader, [RunStatus.FAILED_RESUMABLE])
            except StoreError:
                await asyncio.sleep(0.5)
                continue
            finished = counts.get(RunStatus.FINISHED, 0)
            if finished != self.finished:
                self.finished = finished
                self.progressed.set()
            for run in failed:
                if run.failure_code == "DLQ_PARKED" and run.run_id not in self.resuming:
                    self.resuming.add(run.run_id)
                    self.tasks.append(asyncio.create_task(self.replay(run)))
            for run in paused:
                if run.run_id in self.resuming:
                    continue
                count += 1
                via_cli = self.cfg.cli_resume_every > 0 and count % self.cfg.cli_resume_every == 0
                self.resuming.add(run.run_id)
                self.tasks.append(asyncio.create_task(self.resume(run.run_id, via_cli)))
            await asyncio.sleep(0.3)

    async def resume(self, run_id: str, via_cli: bool) -> None:
        assert self.publisher is not None
        try:
            if via_cli:
                done = await asyncio.to_thread(
                    subprocess.run,
                    [
                        sys.executable,
                        "-m",
                        "runner",
                        "resume",
                        run_id,
                        "--answer",
                        "approved=yes",
                        "--json",
                    ],
                    env=self.env(),
                    capture_output=True,
                    timeout=60,
                    check=False,
                )
                ok = done.returncode == 0
                if not ok:
                    self.say(
                        f"runfleet resume {run_id} exit {done.returncode}: "
                        f"{done.stdout.decode()[-300:]} {done.stderr.decode()[-300:]}"
                    )
            else:
                try:
                    await self.publisher.resume(
                        run_id, ResumeRequest(cli_answers={"approved": "yes"}), tenant=TENANT
                    )
                    ok = True
                except RunfleetError as exc:
                    self.say(f"resume {run_id} refused: {exc!r}")
                    ok = False
            if ok:
                self.report.resumes += 1
                self.report.resumes_cli += via_cli
            else:
                self.report.resume_retries += 1
                await asyncio.sleep(1.0)
        finally:
            self.resuming.discard(run_id)

    async def replay(self, run: RunDocument) -> None:
        """What an operator does with a run parked `DLQ_PARKED` (§5.6): replay its record.
        Under this much chaos a message can spend its whole delivery budget on executions that
        were each interrupted; the verdict checks that every one of them was."""
        assert self.publisher is not None and self.store is not None
        try:
            events = await _events(self.store, run.run_id)
            parks = [e for e in events if e.type == "run_dlq_parked" and e.attempt == run.attempt]
            if not parks:
                return  # the event follows the park: judged again on the next pass
            said = parks[-1].data.get("record_id")
            if said is None:  # a repaired event (`runner.repair`) names no record: look it up
                assert self.dlq is not None
                records = [
                    r
                    for r in await self.dlq.list()
                    if r.run_id == run.run_id and r.attempt == run.attempt
                ]
                if not records:
                    return  # judged again on the next pass
                said = records[-1].id
            record_id = int(said)
            self.say(f"run {run.run_id} parked DLQ_PARKED (record {record_id}); replaying it")
            await self.publisher.replay(record_id, tenant=TENANT)
            self.parked[run.run_id].append((run.attempt, record_id))
            self.report.replays += 1
        except (RunfleetError, OSError) as exc:
            self.say(f"replay of {run.run_id} failed: {exc!r}")
            await asyncio.sleep(1.0)
        finally:
            self.resuming.discard(run.run_id)

    def finished_at_least(self, count: int) -> bool:
        return self.finished >= count

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition` holds; re-judged whenever a run is launched or finishes."""
        while not condition():
            self.progressed.clear()
            await self.progressed.wait()

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

    async def killer(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(self.cfg.kill_every * self.rng.uniform(0.6, 1.4))
            if self.cfg.max_kills is not None and self.report.kills >= self.cfg.max_kills:
                return
            if self.nats_down:
                continue
            candidates = self.eligible()
            if not candidates:
                continue
            rp = self.rng.choice(candidates)
            rp.expected_exit = "killed"
            rp.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(rp.proc.wait)
            self.mark_ended(rp, "killed")
            self.report.kills += 1
            self.say(f"SIGKILL runner {rp.index} ({rp.owner}); kill #{self.report.kills}")
            self.respawn(rp.index)

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

    async def monitor(self) -> None:
        """SPEC §13.5: no fleet run stays queued / running / auto-resumable failed_resumable
        with no live lease and no pending message past the sweeper's interval plus grace."""
        assert self.reader is not None and self.js is not None
        from engine.failures import is_auto_resumable

        skew = timedelta(seconds=float(TIMING["LEASE_SKEW"][:-1]))
        bound = 3 * SWEEPER_INTERVAL_S + SWEEPER_GRACE_S + ACK_WAIT_S + 10.0
        while not self.stop.is_set():
            await asyncio.sleep(1.0)
            if (
                self.nats_down
                or self.in_window("store", slack=0)
                or self.in_window("post_engine", slack=0)
            ):
                continue
            try:
                runs = await _list(
                    self.reader,
                    [RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.FAILED_RESUMABLE],
                )
            except StoreError:
                continue
            now = utcnow()
            seen: set[str] = set()
            for run in runs:
                if run.status is RunStatus.FAILED_RESUMABLE and not is_auto_resumable(
                    run.failure_code
                ):
                    continue
                if run.lease is not None and run.lease.expires_at + skew > now:
                    continue
                pub = run.publication
                if pub is not None and pub.attempt == run.attempt and pub.stream_seq:
                    try:
                        await self.js.get_msg(self.names.runs_stream, pub.stream_seq)
                        continue  # its message waits (a nak delay or ack_wait)
                    except NotFoundError:
                        pass
                    except Exception:  # noqa: BLE001 - NATS hiccup: judge on the next pass
                        continue
                seen.add(run.run_id)
                first = self.orphans.setdefault(run.run_id, time.monotonic())
                since = max(first, self.last_fault_end())
                if time.monotonic() - since > bound:
                    self.report.violations.append(
                        f"run {run.run_id} orphaned for {time.monotonic() - first:.1f}s"
                        f" (> {bound:.1f}s) as {run.status} attempt {run.attempt}"
                        f" publication {pub}"
                    )
                    self.orphans[run.run_id] = float("inf")  # report once
            for run_id in list(self.orphans):
                if run_id not in seen:
                    age = time.monotonic() - self.orphans.pop(run_id)
                    if age >= 1.0:
                        self.report.orphans_repaired += 1
                        self.report.max_orphan_s = max(self.report.max_orphan_s, age)

    async def dlq_watch(self) -> None:
        """Every DLQ record that ever stands, for the verdict (`judge_dlq_history`); and no run
        stands behind one — `queued`, `running` or auto-resumable at the record's attempt —
        longer than a park's write can take in a store outage (SPEC v2.2 §5.1: the record
        first, then the park; a park that does not land withdraws the record)."""
        assert self.dlq is not None and self.reader is not None
        bound = 2 * SQLITE_BUSY_TIMEOUT_S + 10.0
        while not self.stop.is_set():
            await asyncio.sleep(1.0)
            if self.nats_down:
                continue
            try:
                records = await self.dlq.list()
            except Exception:  # noqa: BLE001 - NATS hiccup: look again on the next pass
                continue
            now = time.monotonic()
            for rec in records:
                first, _ = self.dlq_seen.setdefault(rec.id, (now, rec))
                if (
                    rec.id in self.poison
                    or rec.id in self.dlq_behind
                    or rec.run_id is None
                    or now - first <= bound
                ):
                    continue
                try:
                    run = await self.reader.get_run(rec.run_id)
                except RunfleetError:
                    continue
                parked = run.failure_code == "DLQ_PARKED" or run.status in (
                    RunStatus.FINISHED,
                    RunStatus.FAILED,
                    RunStatus.CANCELLED,
                    RunStatus.PAUSED_WAITING_HUMAN,
                )
                if run.attempt == rec.attempt and not parked:
                    self.dlq_behind.add(rec.id)
                    self.report.violations.append(
                        f"run {rec.run_id} stood {run.status} {run.failure_code or ''} at attempt"
                        f" {run.attempt} behind DLQ record {rec.id} ({rec.reason}) for"
                        f" {now - first:.0f}s"
                    )

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

    async def progress(self) -> None:
        assert self.reader is not None
        while not self.stop.is_set():
            await asyncio.sleep(10.0)
            try:
                counts = await self.reader.status_counts()
            except StoreError:
                continue
            statuses = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            self.say(
                f"launched {len(self.launched)}/{self.cfg.runs} finished {self.finished}"
                f" | {statuses} | kills {self.report.kills} restarts {self.report.restarts}"
            )

    # -- chaos -----------------------------------------------------------------------------------

    def plan(self) -> list[tuple[float, str]]:
        steps: list[tuple[float, str]] = [(0.02, "poison"), (0.5, "poison")]
        for i in range(self.cfg.drains):
            steps.append((0.1 + 0.5 * i / self.cfg.drains, "drain"))
        for i in range(self.cfg.nats_restarts):
            steps.append((0.3 + 0.4 * i / self.cfg.nats_restarts, "nats"))
        if self.cfg.nats_cluster > 1:
            for i in range(self.cfg.leader_kills):
                steps.append((0.35 + 0.4 * i / self.cfg.leader_kills, "kill_stream_leader"))
            for i, kind in enumerate(self.cluster_faults().plan(self.cfg.server_faults)):
                steps.append((0.05 + 0.85 * i / self.cfg.server_faults, kind))
        for i in range(self.cfg.store_faults):
            steps.append((0.55 + 0.25 * i / self.cfg.store_faults, "store"))
        for i in range(self.cfg.post_engine_store_faults):
            steps.append((0.4 + 0.3 * i / self.cfg.post_engine_store_faults, "post_engine"))
        return sorted(steps)

    async def chaos(self) -> None:
        try:
            for fraction, kind in self.plan():
                await self.until(
                    functools.partial(self.finished_at_least, int(fraction * self.cfg.runs))
                )
                self.say(f"chaos: {kind} (finished {self.finished})")
                if kind == "poison":
                    await self.send_poison()
                elif kind == "drain":
                    await self.drain_until_a_handoff()
                elif kind == "nats":
                    await self.nats_outage()
                elif kind in KINDS:
                    await self.server_fault(kind)
                elif kind == "store":
                    await self.store_fault()
                elif kind == "post_engine":
                    await self.post_engine_store_fault()
        finally:
            self.chaos_done.set()

    async def busiest(self, within: float) -> tuple[RunnerProc | None, list[RunDocument]]:
        """The runner holding the most live leases on runs at the `work` node."""
        assert self.reader is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                running = await _list(self.reader, [RunStatus.RUNNING])
                now = utcnow()
                held: dict[str, list[RunDocument]] = defaultdict(list)
                for run in running:
                    cp = run.checkpoint
                    if (
                        run.lease is not None
                        and run.lease.expires_at > now
                        and cp is not None
                        and cp.restart_node == "work"
                    ):
                        held[run.lease.owner].append(run)
                live = {rp.owner: rp for rp in self.eligible()}
                best = max((o for o in held if o in live), key=lambda o: len(held[o]), default=None)
                if best is not None:
                    return live[best], held[best]
            await asyncio.sleep(0.1)
        candidates = self.eligible()
        return (self.rng.choice(candidates) if candidates else None), []

    async def drain(
        self, *, outage: bool, target: tuple[RunnerProc | None, list[RunDocument]] | None = None
    ) -> None:
        rp, held = target or await self.busiest(within=30)
        if rp is None:
            self.report.violations.append("drain: no live runner to drain")
            return
        self.protected.add(rp.index)
        drain = Drain(
            owner=rp.owner,
            outage=outage,
            held={r.run_id: r.attempt for r in held},
            tokens={r.run_id: r.lease.token for r in held if r.lease is not None},
            sent_at=time.time(),
        )
        self.drain_log.append(drain)
        self.report.drains += 1
        self.report.drain_held.append((outage, len(held)))
        rp.expected_exit = "drained"
        self.say(
            f"SIGTERM runner {rp.index} ({rp.owner}) holding {len(held)} runs at `work`"
            + (" during the NATS outage" if outage else "")
        )
        sent = time.monotonic()
        rp.proc.send_signal(signal.SIGTERM)
        limit = UNWIND_CEILING_S + 30.0
        try:
            drain.exit_code = await asyncio.to_thread(rp.proc.wait, limit)
        except subprocess.TimeoutExpired:
            rp.proc.kill()
            await asyncio.to_thread(rp.proc.wait)
            self.report.violations.append(
                f"drained runner {rp.owner} still alive {limit:.0f}s after SIGTERM; killed"
                f" (log {rp.log_path})"
            )
        drain.took_s = time.monotonic() - sent
        self.mark_ended(rp, "drained")
        self.say(f"runner {rp.index} drained: exit {drain.exit_code} in {drain.took_s:.1f}s")
        if drain.exit_code not in (0, None):
            self.report.violations.append(
                f"drained runner {rp.owner} exited {drain.exit_code}, not 0: {rp.cause()}"
                f" (log {rp.log_path})"
            )
        elif drain.took_s > UNWIND_CEILING_S:
            self.report.violations.append(
                f"drained runner {rp.owner} took {drain.took_s:.1f}s (ceiling {UNWIND_CEILING_S})"
            )
        self.protected.discard(rp.index)
        self.respawn(rp.index)

    async def drain_until_a_handoff(self, tries: int = 3) -> None:
        """A drain whose held runs all finished `work` between the soak's read and the SIGTERM
        hands nothing off and proves nothing (`judge_drains` accepts it): drain another busy
        runner, up to `tries` times, until one run is handed off."""
        for _ in range(tries):
            await self.drain(outage=False)
            if await self.handed_off(self.drain_log[-1]):
                return
            self.say("the drain caught no run mid-node (they finished first); draining again")

    async def handed_off(self, drain: Drain) -> bool:
        assert self.store is not None
        for run_id, attempt in drain.held.items():
            with contextlib.suppress(StoreError):
                for e in await _events(self.store, run_id):
                    kind, moved = e.data.get("kind"), e.data.get("attempt") == attempt + 1
                    if e.type == "run_queued" and kind == "handoff" and moved:
                        return True
        return False

    async def nats_outage(self) -> None:
        # The runner to drain is chosen first (it holds runs mid-`work`), so the runs are
        # still held when it gets SIGTERM an instant after the server is gone.
        target = await self.busiest(within=30)
        if target[0] is not None:
            self.protected.add(target[0].index)
        window = Window("nats", time.monotonic())
        self.windows.append(window)
        self.nats_down = True
        try:
            await asyncio.to_thread(self.server.stop)
            stopped = time.monotonic()
            self.say("nats-server stopped")
            # A runner drained now cannot publish its handoffs: the sweeper must.
            await self.drain(outage=True, target=target)
            await asyncio.sleep(max(0.0, self.cfg.nats_outage_s - (time.monotonic() - stopped)))
        finally:
            await asyncio.to_thread(self.server.start)
            self.nats_down = False
            window.end = time.monotonic()
            self.report.nats_restarts += 1
            self.say(f"nats-server started again at {self.server.url}")

    def cluster_faults(self) -> ClusterFaults:
        """The cluster's fault maker (`tests/soak_cluster.py`), made once."""
        if self.faults is None:
            assert isinstance(self.server, Cluster)
            self.faults = ClusterFaults(
                self.server,
                stream=self.names.runs_stream,
                consumer=self.names.consumer,
                backstop=(self.names.advisory_stream, self.names.backstop_consumer),
                outage_s=self.cfg.leader_outage_s,
                pause_s=self.cfg.pause_s,
                rng=random.Random(self.cfg.seed + 1),
                say=self.say,
            )
        return self.faults

    async def server_fault(self, kind: str) -> None:
        """One fault of one cluster node, over once the cluster is whole again (restarted,
        resumed, current, every leader elected)."""
        window = Window("cluster", time.monotonic())
        self.windows.append(window)
        try:
            fault = await self.cluster_faults().run(kind)
        finally:
            window.end = time.monotonic()
        self.report.server_faults[kind] += 1
        self.report.leader_kills += kind == "kill_stream_leader"
        self.report.max_leaderless_s = max(self.report.max_leaderless_s, fault.broker_wait_s)

    async def store_fault(self) -> None:
        """Hold SQLite's write lock longer than the busy timeout: every writer of every process
        waits, then gets SQLITE_BUSY (`StoreUnavailable`); readers go on (WAL)."""
        window = Window("store", time.monotonic())
        self.windows.append(window)
        seconds = self.cfg.store_fault_s
        self.say(f"store fault: holding the SQLite write lock for {seconds:.0f}s")
        try:
            await asyncio.to_thread(self.hold_write_lock, seconds)
        finally:
            window.end = time.monotonic()
            self.report.store_fault_windows += 1
            self.say("store fault over")

    def hold_write_lock(self, seconds: float, on_locked: Callable[[], None] | None = None) -> None:
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        try:
            conn.execute("BEGIN EXCLUSIVE")
            if on_locked is not None:
                on_locked()
            time.sleep(seconds)
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    async def post_engine_store_fault(self) -> None:
        """A store outage opened at the instant a run's last node is done and its `finished`
        status write goes (the seam, `tests/soak_seam.py`), held past two busy timeouts: the
        store refuses that write (`StoreUnavailable`), which must end as a nak with the transient
        delay and no DLQ record, with teardown and release still attempted (SPEC v2.2 §5.1,
        §5.6; ADR-0010); the run stays `running` until its lease lapses, then the redelivery's
        adoption finds the last checkpoint written and finishes it. Every other writer of the
        fleet meets the outage too (lease refreshes, checkpoints, claims)."""
        self.seam.arm()
        caught = await self.seam.caught(POST_ENGINE_CATCH_S, self.stop)
        if caught is None and not self.seam.disarm():
            caught = await self.seam.caught(1.0, self.stop)  # caught as we gave up
        if caught is None:
            self.say("post-engine store fault: no `finished` status write to catch; skipped")
            return
        holder = next((rp for rp in self.runners if rp.proc.pid == caught.pid), None)
        if holder is not None:
            self.protected.add(holder.index)  # neither killed nor drained while it is caught
        window = Window("post_engine", time.monotonic())
        self.windows.append(window)
        self.caught.append(caught.run_id)
        seconds = self.cfg.post_engine_store_fault_s
        self.say(
            f"post-engine store fault: run {caught.run_id} is at its status write; holding the"
            f" SQLite write lock for {seconds:.0f}s"
        )
        try:
            await asyncio.to_thread(
                self.hold_write_lock, seconds, functools.partial(self.seam.locked, caught.run_id)
            )
        finally:
            window.end = time.monotonic()
            self.report.post_engine_windows += 1
            if holder is not None:
                self.protected.discard(holder.index)
            self.say("post-engine store fault over")

    async def send_poison(self) -> None:
        """A few deliberately bad messages; each must end in the DLQ with its reason."""
        assert self.js is not None
        await self.until(lambda: bool(self.launched))  # the intruder knocks at a real run
        victim = self.launched[-1]
        old = utcnow() - timedelta(minutes=5)
        for i in range(self.cfg.poison_per_batch):
            kind = i % 4
            headers: dict[str, str] | None = None
            if kind == 0:
                reason, body = "malformed", b"\xff" + self.rng.randbytes(self.rng.randrange(64))
            elif kind == 1:
                reason, body = "malformed", json.dumps({"v": 1, "run_id": i}).encode()
            elif kind == 2:
                lost = RunMessage(
                    run_id=new_run_id(), tenant=TENANT, attempt=1, kind="launch", published_at=old
                )
                reason, (body, headers) = "run_not_found", encode(lost)
            else:
                intruder = RunMessage(
                    run_id=victim,
                    tenant="intruder",
                    attempt=1,
                    kind="launch",
                    published_at=utcnow(),
                )
                reason, body = "tenant_mismatch", intruder.model_dump_json().encode()
            ack = await self.js.publish(
                self.names.runs_subject, body, stream=self.names.runs_stream, headers=headers
            )
            self.poison[ack.seq] = reason
        if not self.cfg.hostile_poison:
            return
        for hostile in hostile_bodies(victim, old):
            ack = await self.js.publish(
                self.names.runs_subject,
                hostile.body,
                stream=self.names.runs_stream,
                headers=hostile.headers,
            )
            self.poison[ack.seq] = "malformed"
            self.report.hostile += 1

    # -- the verdict -----------------------------------------------------------------------------

    async def analyse(self) -> Report:
        assert self.store is not None and self.dlq is not None
        rep = self.report
        rep.wall_s = time.monotonic() - self.started
        rep.data_dir = str(self.root)
        rep.runs = len(self.launched)
        rep.launch_refused = len(self.refused)
        rep.poison = len(self.poison)
        if self.interrupted:
            rep.interrupted = True
            rep.violations.append("interrupted (SIGINT/SIGTERM) before every run finished")
        if len(self.launched) < self.cfg.runs:
            rep.violations.append(f"only {len(self.launched)} of {self.cfg.runs} runs launched")
        await self.leases_settle(within=ACK_WAIT_S + 2.0)
        rep.dedupe_answered = self.dedupe.count + count_dedupe_answers(
            proc.log() for proc in self.history
        )
        assert self.js is not None
        try:
            rep.redeliveries = await count_redeliveries(self.js, self.names)
        except Exception as exc:  # noqa: BLE001 - evidence only: the verdict does not need it
            self.say(f"delivery log not read: {exc!r}")
        lines = _ledger(self.ledger)
        completions = _ledger(self.done)
        killed_like = {rp.owner: rp for rp in self.history if rp.owner and rp.ended}
        for run_id in self.launched:
            doc = await self.store.get_run(run_id)
            events = self.events[run_id] = await _events(self.store, run_id)
            self.judge_run(
                doc, events, lines.get(run_id, []), completions.get(run_id, []), killed_like
            )
        self.judge_drains()
        records = await self.dlq.list()
        rep.dlq_records = len(records)
        self.judge_status_refusals()
        self.judge_dlq_history(standing={r.id for r in records})
        got = {r.id: r.reason for r in records}
        if got != self.poison:
            extra = {k: v for k, v in got.items() if k not in self.poison}
            missing = {k: v for k, v in self.poison.items() if k not in got}
            wrong = {k: (got[k], v) for k, v in self.poison.items() if k in got and got[k] != v}
            rep.violations.append(
                f"DLQ differs from the deliberate poison: extra {extra}, missing {missing},"
                f" wrong reason (got, want) {wrong}"
            )
        return rep

    async def leases_settle(self, within: float) -> None:
        """The last release follows the last status write by a moment: let it land."""
        assert self.reader is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            runs = await _list(self.reader, list(RunStatus))
            now = utcnow()
            if not any(r.lease is not None and r.lease.expires_at > now for r in runs):
                return
            await asyncio.sleep(0.2)

    def judge_run(
        self,
        doc: RunDocument,
        events: list[Any],
        lines: list[tuple[float, str, str]],
        completions: list[tuple[float, str, str]],
        ended: dict[str, RunnerProc],
    ) -> None:
        rep = self.report
        rid = doc.run_id
        claims = {e.execution: e for e in events if e.type == "run_claimed"}
        finished_nodes = {
            (e.execution, e.data.get("node")) for e in events if e.type == "node_finished"
        }
        if any(
            e.type == "node_failed"
            and e.data.get("node") == "flaky"
            and e.data.get("code") == "TOOL_FAILED_TRANSIENT"
            for e in events
        ):
            rep.transient_retries += 1
        rep.handoffs += sum(
            1 for e in events if e.type == "run_queued" and e.data.get("kind") == "handoff"
        )
        if doc.status is RunStatus.FINISHED:
            rep.finished += 1
            cp = doc.checkpoint
            if cp is None or list(cp.completed) != list(COMPLETED):
                rep.violations.append(
                    f"run {rid} finished with completed nodes {cp.completed if cp else None}"
                )
            elif (cp.outputs.get("approve") or {}).get("approved") is not True:
                rep.violations.append(f"run {rid} finished without its answer: {cp.outputs}")
            finishes = sum(1 for e in events if e.type == "run_finished")
            if finishes > 1:
                rep.duplicated += 1
                rep.violations.append(f"run {rid} has {finishes} run_finished events")
            elif finishes == 0:
                rep.missing_events += 1
                owner = doc.lease.owner if doc.lease is not None else "?"
                rep.violations.append(
                    f"run {rid} is finished but has no run_finished event (runner {owner} wrote"
                    " the status and died before the event; nothing repairs it)"
                )
            if not completions:
                rep.violations.append(f"run {rid} finished but its final node left no line")
        else:
            orphan = doc.lease is None and doc.status in (
                RunStatus.QUEUED,
                RunStatus.RUNNING,
                RunStatus.FAILED_RESUMABLE,
            )
            if orphan:
                rep.lost += 1
            else:
                rep.stuck += 1
            rep.violations.append(
                f"run {rid} ended {doc.status} {doc.failure_code or ''} attempt {doc.attempt}"
                f" lease {doc.lease} publication {doc.publication}: "
                + ("lost (no owner)" if orphan else "stuck")
            )
        if doc.lease is not None and doc.lease.expires_at > utcnow():
            rep.violations.append(f"run {rid} is {doc.status} and still leased: {doc.lease}")
        elif doc.lease is not None:
            rep.stale_leases += 1  # its runner died between the status write and the release
        by_node: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for at, node, token in lines:
            by_node[node].append((at, token))
        if doc.status is RunStatus.FINISHED:
            for node in LEDGER_NODES:
                if not by_node.get(node):
                    rep.violations.append(f"run {rid}: node {node} completed but never ran")
        duplicated = False
        for node, runs in by_node.items():
            runs.sort()
            tokens = [t for _, t in runs]
            if len(set(tokens)) != len(tokens):
                duplicated = True
                rep.violations.append(f"run {rid}: node {node} ran twice in one execution {tokens}")
            for at, token in runs[:-1]:  # every line but the last was cut short
                rep.rerun_nodes += 1
                if (token, node) in finished_nodes:
                    duplicated = True
                    rep.violations.append(
                        f"run {rid}: node {node} completed by execution {token} (node_finished)"
                        f" and executed again (SPEC §13.6)"
                    )
                    continue
                cause = self.explain(rid, token, at, claims, ended)
                rep.rerun_causes[cause] += 1
                if cause == "unexplained":
                    duplicated = True
                    claim = claims.get(token)
                    rep.violations.append(
                        f"run {rid}: node {node} re-ran after execution {token}"
                        f" (runner {claim.data.get('runner') if claim else '?'}) though nothing"
                        " interrupted it"
                    )
        rep.duplicated += duplicated
        for attempt, record_id in self.parked.get(rid, []):
            for claim in (e for e in events if e.type == "run_claimed" and e.attempt == attempt):
                why = self.explain(
                    rid, claim.execution, claim.at.timestamp(), claims, ended, within=60.0
                )
                if why == "unexplained":
                    rep.violations.append(
                        f"run {rid}: attempt {attempt} spent its delivery budget (DLQ record"
                        f" {record_id}), yet execution {claim.execution} of it was not interrupted"
                    )

    def explain(
        self,
        run_id: str,
        token: str,
        at: float,
        claims: dict[str | None, Any],
        ended: dict[str, RunnerProc],
        within: float = 30.0,
    ) -> str:
        """Why an execution that was doing something at `at` (epoch s) did not finish it: its
        runner ended (killed, drained, crashed) within `within` s after, a store or NATS fault
        window was around it, or its runner logged the lease lost. Else `unexplained`."""
        claim = claims.get(token)
        owner = claim.data.get("runner") if claim is not None else None
        rp = ended.get(owner or "")
        if rp is not None and at <= rp.ended_at <= at + within:
            return {"killed": "kill", "drained": "drain", "crashed": "crash"}.get(rp.ended, "?")
        for w in self.windows:
            start = time.time() - (time.monotonic() - w.start)
            end = time.time() - (time.monotonic() - w.end) if w.end != float("inf") else 1e12
            if start - (SQLITE_BUSY_TIMEOUT_S + 10.0) <= at <= end + 5.0:
                return f"{w.kind}_fault"
        for proc in self.history:
            if proc.owner == owner and (
                f"run {run_id}: lease lost" in (log := proc.log())
                or f"run {run_id}: lease {token} taken over" in log
            ):
                return "lease_lost"
        return "unexplained"

    def judge_status_refusals(self) -> None:
        """Count the status writes the store refused (`status not written`), and those the
        post-engine faults caught."""
        refused: set[str] = set()
        for proc in self.history:
            for found in _STATUS_REFUSED.finditer(proc.log()):
                self.report.status_refused += 1
                if found["error"] == "StoreUnavailable":
                    refused.add(found["run"])
        self.report.post_engine_refused = sum(1 for run_id in self.caught if run_id in refused)

    def judge_dlq_history(self, standing: set[int]) -> None:
        """No DLQ record for a real run unless the soak dead-lettered it on purpose (its poison
        names a real run too) — with one exception chaos earns: a run whose delivery budget was
        spent, parked and replayed by the soak (`replay`; every execution of that attempt must
        have been interrupted, `judge_run`), or such a park's record withdrawn because the park
        did not land (ADR-0010). A store outage never makes a record (SPEC v2.2 §5.1, §5.6)."""
        rep = self.report
        real = set(self.launched) | set(self.refused)
        replayed = {record_id for pairs in self.parked.values() for _, record_id in pairs}
        for record_id, (_, rec) in sorted(self.dlq_seen.items()):
            if record_id in self.poison:
                continue
            about = (
                f"DLQ record {record_id} ({rec.reason}: {rec.detail[:200]}) for run {rec.run_id}"
            )
            withdrawn = record_id not in standing and record_id not in replayed
            if withdrawn and rec.reason == "retries_exhausted":
                rep.dlq_withdrawn += 1  # written first at a last delivery; the park did not land
            elif _STORE_ERROR.search(rec.detail):
                rep.violations.append(f"{about}: a store outage made a DLQ record")
            elif record_id in replayed:
                rep.dlq_chaos += 1
            elif rec.run_id in real:
                rep.violations.append(f"{about}: a real run the soak did not dead-letter")
            # else: a record for no real run, not poison: the exact-DLQ check names it if it stands

    def judge_drains(self) -> None:
        rep = self.report
        for drain in self.drain_log:
            if drain.outage:
                continue  # its handoffs cannot publish; the orphan checks judge the sweeper
            for run_id, attempt in drain.held.items():
                events = self.events.get(run_id, [])
                handed = any(
                    e.type == "run_queued"
                    and e.data.get("kind") == "handoff"
                    and e.data.get("attempt") == attempt + 1
                    for e in events
                )
                completed_first = any(
                    e.type == "node_finished"
                    and e.execution == drain.tokens.get(run_id)
                    and e.data.get("node") == "finish"
                    for e in events
                )
                if not handed and not completed_first:
                    rep.violations.append(
                        f"drain of {drain.owner}: run {run_id} (attempt {attempt}, at `work`)"
                        " was not handed off"
                    )


async def _list(store: SqliteRunStore, statuses: list[RunStatus]) -> list[RunDocument]:
    out: list[RunDocument] = []
    after: str | None = None
    while True:
        page = await store.list_runs(
            RunQuery(statuses=statuses, tenant=TENANT, after_run_id=after, limit=500)
        )
        out.extend(page.runs)
        if page.next_after is None:
            return out
        after = page.next_after


async def _events(store: SqliteRunStore, run_id: str) -> list[Any]:
    events: list[Any] = []
    after = 0
    while True:
        page = await store.read_events(run_id, after_seq=after, limit=1000)
        events.extend(page)
        if len(page) < 1000:
            break
        after = page[-1].seq
    return events


async def _quiet(exc: Exception) -> None:
    return None


def _ledger(path: Path) -> dict[str, list[tuple[float, str, str]]]:
    """run id -> [(time, node, execution token)] in file order."""
    out: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            out[parts[1]].append((float(parts[0]), parts[2], parts[3]))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


async def run_soak(cfg: SoakConfig, *, handle_signals: bool = False) -> Report:
    """Run the soak; with `handle_signals` (the command line), SIGINT/SIGTERM stop it early and
    still clean up and report."""
    soak = Soak(cfg)
    failed = True
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(soak, "interrupted", True))
    try:
        await soak.start()
        await soak.drive()
        report = await soak.analyse()
        failed = not report.ok
        return report
    finally:
        await soak.close()
        if soak.own_tmp and not cfg.keep and not failed:
            shutil.rmtree(soak.root, ignore_errors=True)


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
