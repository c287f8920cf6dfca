"""The embedded fleet (`runfleet up`, SPEC §10, §12): a local nats-server (unless
`RUNFLEET_NATS_URL` is set), the streams, N runner *processes* (a killed runner must be a
killed process) sharing the SQLite store and filesystem blobs under `RUNFLEET_DATA`, and a live
view. A runner process that dies is restarted. Ctrl-C (or SIGTERM) drains the runners — each
hands its in-flight runs off — then stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from publisher.config import NATS_URL_FILE, WireSettings
from publisher.connection import connect
from publisher.nats_errors import JETSTREAM_UNANSWERED
from publisher.streams import EnsureReport, ensure_streams, leaderless
from publisher.wire import WireNames
from runner import fleet_settings
from runner.config import RunnerSettings
from runner.jetstream_room import Room, read_room, restart_helps
from runner.localcluster import NatsCluster
from runner.localnats import NatsServer
from runner.logfiles import rotate_if_large
from store import RunStore

log = logging.getLogger(__name__)
T = TypeVar("T")
_PORT_LINE = re.compile(rb"slots, http :(\d+)")
_ERROR_LINE = re.compile(rb"^error \[([a-z0-9_]+)\]: (.*)$", re.MULTILINE)
QUICK_EXIT_S = 10.0
"""A runner that dies sooner than this after its start is restarted after a delay."""
ROOM_EVERY_S = 5.0
"""How often `up` asks its nats-servers whether JetStream still has room (`_watch_room`)."""
SILENT_CHECKS = 3
"""Checks in a row a live server's monitor must miss before `up` says it hangs."""
ROOM_RESTART_MAX_S = 600.0
"""The longest wait between two restarts of one server for room."""
MAX_BACKOFF_S = 30.0


@dataclass
class RunnerProcess:
    index: int
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    http_port: int | None = None
    """The port of the *current* process: read from what it logged since it started."""
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    log_offset: int = 0
    """Where this start's lines begin in the appended log (earlier starts held other ports)."""
    last_exit: str | None = None
    """Why the last process ended: its exit code and the error it printed, for the view."""
    backoff_s: float = 0.0
    restart_at: float | None = None
    """When a dead process is started again: at once after a long life, later after each
    quick death in a row (a runner whose settings cannot work would otherwise restart, fail
    and log in a tight loop until someone fixes them)."""


@dataclass
class NatsWatch:
    """What `up` knows of its own nats-server's deaths, for restarts and the view."""

    restarts: int = 0
    last_exit: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    backoff_s: float = 0.0
    restart_at: float | None = None
    """While the server is down: when it is started again."""
    room: Room | None = None
    """What its JetStream last said of its room, while it has none (runner/jetstream_room.py)."""
    room_checked_at: float = 0.0
    room_restarts: int = 0
    room_restart_after: float = 0.0
    """No restart for room before this `time.monotonic()` (each one doubles the wait)."""
    silent: int = 0
    """Checks in a row its monitor did not answer, the process alive (a hung server)."""


async def _until_answered(deadline: float, ask: Callable[[], Awaitable[T]]) -> T:
    """`ask()`, asked again while JetStream does not answer (a leader election), until
    `deadline` (then its last error)."""
    async for attempt in AsyncRetrying(
        stop=stop_after_delay(max(0.0, deadline - time.monotonic())),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        retry=retry_if_exception_type((*JETSTREAM_UNANSWERED, TimeoutError)),
        before_sleep=_said_unanswered,
        reraise=True,
    ):
        with attempt:
            return await ask()
    raise AssertionError("unreachable: tenacity re-raises the last error")


async def _all_led(js: JetStreamContext, names: WireNames) -> None:
    if missing := await leaderless(js, names):
        raise TimeoutError(f"no leader yet: {', '.join(missing)}")


def _said_unanswered(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.info("the streams did not answer yet (%r); asking again", exc)


def next_backoff(previous_s: float, started_at: float, now: float) -> float:
    """The delay before a dead process (a runner, `up`'s nats-server) is started again: none
    after a long life, doubling from 1 s up to `MAX_BACKOFF_S` after quick deaths in a row."""
    if now - started_at >= QUICK_EXIT_S:
        return 0.0
    return min(MAX_BACKOFF_S, max(1.0, previous_s * 2))


def describe_exit(code: int | None) -> str:
    """`exit 2`, or `killed by SIGKILL` for a process a signal ended (a negative status)."""
    if code is None:
        return "exited"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


@dataclass(frozen=True, slots=True)
class RunnerRow:
    """One runner as the live view shows it (SPEC §10 `up`: pid, port, slots, runs)."""

    index: int
    pid: int | None
    http_port: int | None
    slots: int
    slots_in_use: int | None
    """Deliveries it holds (its `/healthz` `inflight`); None when it did not answer."""
    runs_in_flight: int | None
    """Executions it runs (`runfleet_inflight_runs`); None when it did not answer."""
    restarts: int
    answering: bool
    last_exit: str | None = None
    """Why its last process ended (`exit 2 [consumer_mismatch] …`, `killed by SIGKILL`): the
    reason it is down, or beside its restarts once it runs again."""
    restart_in_s: float | None = None


class EmbeddedFleet:
    def __init__(
        self,
        *,
        data: Path,
        runners: int,
        slots: int,
        store: RunStore,
        env: dict[str, str] | None = None,
        nats_cluster: int = 1,
        lock_fd: int | None = None,
    ) -> None:
        self.data = data.resolve()
        self.pass_fds = () if lock_fd is None else (lock_fd,)
        """`hold_data_dir`'s lock, inherited by every process the fleet starts: the data dir
        stays held while any of them runs, even after a SIGKILLed `up`."""
        self.nats_cluster = nats_cluster
        """Local nats-servers: above 1, a JetStream cluster whose streams get one replica per
        server (`runfleet up --nats-cluster 3`)."""
        self.count = runners
        self.slots = slots
        self.store = store
        self.base_env = dict(env if env is not None else os.environ)
        self.server: NatsServer | NatsCluster | None = None
        self.nats_url = ""
        self._url_written: str | None = None
        """What this fleet wrote to `nats.url`: the only content it may remove."""
        self._settings_written: str | None = None
        """What it wrote to `fleet-settings.json` (`runner.fleet_settings`), likewise."""
        self.procs: list[RunnerProcess] = []
        self.nats: list[NatsWatch] = []
        """The restarts of each nats-server `up` started (one, or each node of a cluster),
        in the order of `_servers()`."""
        self.stopping = False
        self._stop = asyncio.Event()
        self._room_turn: asyncio.Task[None] | None = None
        """The room check in flight, if any (`_watch_room`)."""
        self._server_ops = asyncio.Lock()
        """Held while a nats-server of the fleet's is started or stopped (a restart after a
        death, one for room, the final stop), so shutdown's stop never lands inside a restart
        that would then start a server nobody stops (a review found one left running)."""
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self.names = WireNames()
        self.warnings: list[str] = []
        """What `up` must say at start (a data dir whose JetStream is of the other kind)."""
        self.ensured: EnsureReport | None = None
        """What starting changed on the streams (a setting given to this `up` that differs
        from what the streams were made with): said at start, since runners started with the
        old values elsewhere will refuse to start again."""

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        (self.data / "logs").mkdir(exist_ok=True)
        wire = WireSettings(data=self.data)
        if wire.nats_url:
            self.nats_url = wire.nats_url
        else:
            self._say_other_jetstream()
            self.server = (
                NatsCluster(self.data / "nats-cluster", self.nats_cluster, pass_fds=self.pass_fds)
                if self.nats_cluster > 1
                else NatsServer(self.data / "nats", pass_fds=self.pass_fds)
            )
            await asyncio.to_thread(self.server.start)
            self.nats_url = self.server.url  # a cluster's: its servers, comma-separated
        replicas = self.nats_cluster if self.nats_cluster > 1 else wire.stream_replicas
        wire = WireSettings(data=self.data, nats_url=self.nats_url, stream_replicas=replicas)
        self._nc, self._js = await connect(wire, name="runfleet-up")
        self.names = WireNames(wire.namespace)
        self.ensured = await self._ensure_streams(self._js, wire)
        if self.server is not None:
            # `nats.url` says "launch now": written once the streams take messages. Written at
            # the server's start, a `launch` on a cluster's data dir ran while the raft groups
            # still elected and failed "no stream took the message" (CI, a loaded machine);
            # a command before it is told the fleet is starting (`publisher.connection`). The
            # settings first: a command that sees `nats.url` finds what the fleet runs with.
            self._settings_written = fleet_settings.write(
                self.data, fleet_settings.shared_settings(self._env(), Path.cwd())
            )
            self._write_url()
        for i in range(self.count):
            rp = RunnerProcess(i, self.data / "logs" / f"runner-{i}.log")
            self.procs.append(rp)
            await self._spawn(rp)

    def _say_other_jetstream(self) -> None:
        """A data dir whose JetStream was the other kind (one server, or a cluster) keeps its
        queued messages and DLQ records there, where this `up` does not look: said, not
        refused (found by a cluster walkthrough: `up` without `--nats-cluster` on a cluster's
        data dir started an empty server without a word)."""
        cluster, single = self.data / "nats-cluster", self.data / "nats"
        other, flag = (
            (cluster, "--nats-cluster N")
            if self.nats_cluster == 1
            else (single, "no --nats-cluster")
        )
        if other.is_dir() and any(other.iterdir()):
            note = (
                f"{other} holds the JetStream data of an earlier `up` with {flag}; this `up`"
                " does not read it (queued messages and DLQ records there stay unseen): start"
                f" with {flag} to use it"
            )
            self.warnings.append(note)  # said by `up` at start, with its other start lines

    async def _ensure_streams(self, js: JetStreamContext, wire: WireSettings) -> EnsureReport:
        """`ensure_streams`, waiting out the streams' leader elections. A cluster that answers
        healthy can still have streams without a leader for a few seconds after a restart (the
        raft groups elect after the meta group), and their API calls then go unanswered: `up`
        on a cluster's data dir exited `nats_timeout` at its first lookup, nearly every time,
        and the runs it had handed off stayed until a fleet could start (found by a cluster
        walkthrough). Bounded by `RUNFLEET_CONSUMER_WAIT`, as a starting runner's wait is."""
        deadline = time.monotonic() + RunnerSettings().consumer_wait.total_seconds()
        report = await _until_answered(deadline, lambda: ensure_streams(js, self.names, wire))
        if wire.stream_replicas > 1:
            await _until_answered(deadline, lambda: _all_led(js, self.names))
        return report

    def _write_url(self) -> None:
        """Replaced whole (a command reading it never sees half a URL)."""
        text = self.nats_url + "\n"
        staged = self.data / f"{NATS_URL_FILE}.{os.getpid()}"
        staged.write_text(text)
        staged.replace(self.data / NATS_URL_FILE)
        self._url_written = text

    def _remove_url(self) -> None:
        """Only the URL this fleet wrote: a `nats.url` that says anything else belongs to
        another fleet (or a person), and removing it would cut that fleet off from the CLI."""
        path = self.data / NATS_URL_FILE
        if self._url_written is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if path.read_text() == self._url_written:
                path.unlink()
        self._url_written = None

    def _env(self) -> dict[str, str]:
        env = dict(self.base_env)
        env["RUNFLEET_DATA"] = str(self.data)
        env["RUNFLEET_NATS_URL"] = self.nats_url
        env.setdefault("RUNFLEET_HTTP_PORT", "0")
        if self.nats_cluster > 1:
            env["RUNFLEET_STREAM_REPLICAS"] = str(self.nats_cluster)
        return env

    async def _spawn(self, rp: RunnerProcess) -> None:
        # Made again if it went (found by an operator walkthrough: `rm -rf DATA/logs` under a
        # running fleet, and the next restart of a runner failed, silently, for good).
        rp.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            rp.log_offset = rp.log_path.stat().st_size
        except FileNotFoundError:
            rp.log_offset = 0
        logf = rp.log_path.open("ab")
        try:
            rp.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "runner",
                "runner",
                "--slots",
                str(self.slots),
                env=self._env(),
                stdout=logf,
                stderr=subprocess_stdout(),
                start_new_session=True,  # Ctrl-C reaches `up` only; it drains the runners
                pass_fds=self.pass_fds,
            )
        finally:
            logf.close()
        rp.http_port = None
        rp.started_at = time.monotonic()

    # -- supervise ---------------------------------------------------------------------------

    async def supervise(self) -> None:
        """Restart runner processes that die (until the fleet stops): at once after a long
        life, with a doubling delay after quick deaths in a row (`QUICK_EXIT_S`)."""
        while not self.stopping:
            for rp in self.procs:
                if rp.proc is not None and rp.proc.returncode is not None and not self.stopping:
                    now = time.monotonic()
                    if rp.restart_at is None:
                        self._note_exit(rp, rp.proc.returncode, now)
                    if now >= (rp.restart_at or now):
                        rp.restarts += 1
                        rp.restart_at = None
                        try:
                            await self._spawn(rp)
                        except OSError as exc:  # tried again after a longer delay, and said
                            self._note_spawn_failure(rp, exc, now)
                if rp.http_port is None and rp.proc is not None and rp.proc.returncode is None:
                    rp.http_port = _read_port(rp.log_path, rp.log_offset)
                if rotate_if_large(rp.log_path):
                    rp.log_offset = 0  # this start's lines before the cut are in `.1`
            await self._watch_nats()
            await self._watch_room()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.5)

    def _servers(self) -> list[tuple[str, NatsServer]]:
        """The nats-servers `up` started, by the name the log and the view give them: the one
        server, or each node of a cluster (`nats-server n2`)."""
        if isinstance(self.server, NatsCluster):
            return [
                (f"nats-server {self.server.name(k)}", node)
                for k, node in enumerate(self.server.nodes)
            ]
        if isinstance(self.server, NatsServer):
            return [("nats-server", self.server)]
        return []

    async def _watch_nats(self) -> None:
        """Start a nats-server of the fleet's again when it died under the fleet (found by an
        on-call walkthrough: a SIGKILLed server left every runner retrying its connection
        forever and the view silent; and by a cluster walkthrough: a dead node stayed dead,
        its replicas lost, without a word). Same ports and JetStream directory, so the streams
        and every queued message come back (a node catches up from its peers), and the
        runners' clients reconnect by themselves."""
        servers = self._servers()
        while len(self.nats) < len(servers):
            self.nats.append(NatsWatch())
        for (label, server), watch in zip(servers, self.nats, strict=False):
            if not self.stopping and not server.running:
                await self._restart_server(label, server, watch)

    async def _restart_server(self, label: str, server: NatsServer, watch: NatsWatch) -> None:
        now = time.monotonic()
        if watch.restart_at is None:
            watch.backoff_s = next_backoff(watch.backoff_s, watch.started_at, now)
            watch.restart_at = now + watch.backoff_s
            watch.last_exit = describe_exit(server.exit_code)
            log.warning(
                "%s %s; restarting it on port %s%s (log: %s)",
                label,
                watch.last_exit,
                server.port,
                f" in {watch.backoff_s:.0f}s" if watch.backoff_s else "",
                server.log_path,
            )
        if now < watch.restart_at:
            return
        watch.started_at = now
        async with self._server_ops:
            if self.stopping:
                return
            try:
                await asyncio.to_thread(server.start)
            except (RuntimeError, TimeoutError, OSError) as exc:
                watch.restart_at = None  # judged again on the next turn, after a longer delay
                log.error("%s did not start again: %s", label, str(exc).splitlines()[0])
                return
        watch.restart_at = None
        watch.restarts += 1
        log.warning("%s restarted on port %s (restarts %d)", label, server.port, watch.restarts)

    async def _watch_room(self) -> None:
        """Every `ROOM_EVERY_S`, ask each running server whether its JetStream has room. One
        that has none is said once (up.log, the view), and restarted in place as soon as the
        disk has room again: a restart is the only thing that lifts its limit or mends a stream
        whose write the disk refused (runner/jetstream_room.py). The runners reconnect by
        themselves, as after a crash; nothing is lost (the streams are on disk). At most one
        server is restarted a turn, a cluster's node only once it is ready again, so a
        cluster whose nodes share the full disk keeps its quorum.

        A turn runs as a task of its own: a hung server's monitor takes seconds to not
        answer, and a restart waits for the node to catch up, while the supervision loop
        must keep restarting dead runners every half second (a review)."""
        if self._room_turn is None or self._room_turn.done():
            self._room_turn = asyncio.create_task(self._judge_room_logged())

    async def _judge_room_logged(self) -> None:
        try:
            await self._judge_room()
        except Exception:  # the supervision of runners and servers goes on
            log.exception("checking the nats-servers' JetStream room failed; trying again later")

    async def _judge_room(self) -> None:
        now = time.monotonic()
        due = [
            (label, server, watch)
            for (label, server), watch in zip(self._servers(), self.nats, strict=False)
            if server.running
            and server.monitor_url
            and not server.paused
            and now - watch.room_checked_at >= ROOM_EVERY_S
        ]
        if self.stopping or not due:
            return
        async with aiohttp.ClientSession() as session:
            for label, server, watch in due:
                watch.room_checked_at = now
                assert server.monitor_url is not None
                room = await read_room(session, server.monitor_url)
                if room is None:
                    watch.silent += 1
                    if watch.silent == SILENT_CHECKS:
                        # A hung server is not a dead one: `_watch_nats` never restarts it, and
                        # commands only time out (a network drill: SIGSTOP for 90 s).
                        log.error(
                            "%s (pid %s) does not answer (for %.0fs, alive): runners and"
                            " commands wait on it; if it stays so, `kill %s` and `up` starts"
                            " it again",
                            label,
                            server.pid,
                            SILENT_CHECKS * ROOM_EVERY_S,
                            server.pid,
                        )
                    continue
                if watch.silent >= SILENT_CHECKS:
                    log.warning("%s answers again", label)
                watch.silent = 0
                if not room.full:
                    if watch.room is not None:
                        log.warning("%s: JetStream has room again", label)
                    watch.room = None
                    continue
                if watch.room is None:
                    log.error(
                        "%s: %s. Launches, answers and DLQ records are refused until it can"
                        " store again: free space on the disk holding %s; `up` restarts the"
                        " server once there is room",
                        label,
                        room.describe(),
                        server.store_dir,
                    )
                watch.room = room
                if time.monotonic() >= watch.room_restart_after and restart_helps(
                    room, server.store_dir
                ):
                    await self._restart_for_room(label, server, watch)
                    return  # one a turn

    async def _restart_for_room(self, label: str, server: NatsServer, watch: NatsWatch) -> None:
        async with self._server_ops:
            if self.stopping:
                return
            log.warning(
                "%s: the disk holding %s has room again; restarting the server to store again",
                label,
                server.store_dir,
            )
            watch.last_exit = "stopped to store again (JetStream was full)"
            # Each restart for room waits longer before the next: one that did not help (a
            # disk that fills again at once) must not become a restart every few seconds.
            watch.room_restarts += 1
            watch.room_restart_after = time.monotonic() + min(
                ROOM_RESTART_MAX_S, ROOM_EVERY_S * 2**watch.room_restarts
            )
            try:
                if isinstance(self.server, NatsCluster):  # and wait until it caught up
                    await asyncio.to_thread(self.server.restart, self.server.nodes.index(server))
                else:
                    await asyncio.to_thread(server.restart)
            except (RuntimeError, TimeoutError, OSError) as exc:
                # A server left stopped is started again by `_watch_nats`, with its backoff.
                log.error("%s did not start again: %s", label, str(exc).splitlines()[0])
                return
        watch.room = None
        watch.room_checked_at = time.monotonic()
        log.warning("%s restarted on port %s with room to store", label, server.port)

    def _note_spawn_failure(self, rp: RunnerProcess, exc: OSError, now: float) -> None:
        rp.backoff_s = next_backoff(rp.backoff_s, now, now)
        rp.restart_at = now + rp.backoff_s
        rp.last_exit = f"cannot be started again: {exc}"
        log.error("runner %d %s; trying again in %.0fs", rp.index, rp.last_exit, rp.backoff_s)

    def _note_exit(self, rp: RunnerProcess, code: int, now: float) -> None:
        rp.backoff_s = next_backoff(rp.backoff_s, rp.started_at, now)
        rp.restart_at = now + rp.backoff_s
        error = _last_error(rp.log_path, rp.log_offset)
        rp.last_exit = describe_exit(code) + (f" {error}" if error else "")
        log.warning(
            "runner %d: %s; restarting%s (log: %s)",
            rp.index,
            rp.last_exit,
            f" in {rp.backoff_s:.0f}s" if rp.backoff_s else "",
            rp.log_path,
        )

    # -- view --------------------------------------------------------------------------------

    async def snapshot(self, session: aiohttp.ClientSession) -> dict[str, object]:
        counts = await self.store.status_counts()
        rows: list[RunnerRow] = []
        deliveries = 0.0
        for rp in self.procs:
            row, delivered = await self._runner_row(session, rp)
            rows.append(row)
            deliveries += delivered
        return {
            "runs": {str(k): v for k, v in sorted(counts.items())},
            "inflight": sum(r.runs_in_flight or 0 for r in rows),
            "deliveries": deliveries,
            "runners_alive": sum(r.answering for r in rows),
            "runners": rows,
            "dlq": await self.dlq_size(),
            "nats": self.nats_line(),
        }

    def nats_line(self) -> str | None:
        """The view's nats-server rows, only for a server that died: down (and when it comes
        back), or running again after N restarts."""
        lines = []
        for (label, server), watch in zip(self._servers(), self.nats, strict=False):
            if watch.silent >= SILENT_CHECKS and server.running:
                lines.append(f"  {label}  pid {server.pid}  does not answer (hung?)")
                continue
            if watch.room is not None and server.running:
                lines.append(
                    f"  {label}  {watch.room.describe()}; free space on the disk holding"
                    f" {server.store_dir} and `up` restarts it"
                )
                continue
            if watch.restarts == 0 and server.running:
                continue
            if not server.running:
                left = None if watch.restart_at is None else watch.restart_at - time.monotonic()
                when = "restarting" if left is None or left <= 0 else f"restart in {left:.0f}s"
                restarts = f", restarts {watch.restarts}" if watch.restarts else ""
                lines.append(f"  {label}  not running: {watch.last_exit} ({when}{restarts})")
            else:
                lines.append(
                    f"  {label}  pid {server.pid}  :{server.port}"
                    f"  (restarts {watch.restarts}, last: {watch.last_exit})"
                )
        return "\n".join(lines) or None

    async def _runner_row(
        self, session: aiohttp.ClientSession, rp: RunnerProcess
    ) -> tuple[RunnerRow, float]:
        """One runner's row, from its `/healthz` (deliveries held) and `/metrics` (executions,
        deliveries so far); a runner that does not answer shows its pid and nothing else."""
        live = rp.proc is not None and rp.proc.returncode is None
        pid = rp.proc.pid if live and rp.proc is not None else None
        row = RunnerRow(
            rp.index, pid, rp.http_port, self.slots, None, None, rp.restarts, False, rp.last_exit
        )
        if not live:
            wait = None if rp.restart_at is None else max(0.0, rp.restart_at - time.monotonic())
            return dataclasses.replace(row, last_exit=rp.last_exit, restart_in_s=wait), 0.0
        if rp.http_port is None:
            return row, 0.0
        base = f"http://127.0.0.1:{rp.http_port}"
        try:
            async with session.get(f"{base}/healthz") as resp:
                health = await resp.json()
            async with session.get(f"{base}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return row, 0.0
        stats = parse_runner_metrics(text)
        return RunnerRow(
            rp.index,
            pid,
            rp.http_port,
            int(health.get("slots", self.slots)),
            int(health.get("inflight", 0)),
            int(stats.get("runfleet_inflight_runs", 0.0)),
            rp.restarts,
            True,
            rp.last_exit,
        ), stats.get("runfleet_deliveries_total", 0.0)

    async def dlq_size(self) -> int:
        if self._js is None:
            return -1
        try:
            info = await self._js.stream_info(self.names.dlq_stream)
        except NotFoundError:
            return 0
        except Exception:  # noqa: BLE001 - the view shows -1 rather than failing the fleet
            return -1
        return int(info.state.messages)

    # -- stop --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_stop_requested(self) -> None:
        await self._stop.wait()

    async def shutdown(self, grace_s: float) -> None:
        """SIGTERM every runner (each drains and hands off), wait up to `grace_s`, then kill
        what is left; stop the local server last, so the handoffs can still publish."""
        self.stopping = True
        self._stop.set()
        live = [rp.proc for rp in self.procs if rp.proc is not None and rp.proc.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if live:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=grace_s)
            for proc in live:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        if self._room_turn is not None:
            await self._room_turn  # it ends at once now, or after the restart it began
        if self.server is not None:
            async with self._server_ops:  # after any restart in flight, never inside one
                await asyncio.to_thread(self.server.stop)
            self._remove_url()
            if self._settings_written is not None:
                fleet_settings.keep_location(self.data, self._settings_written)
                self._settings_written = None


def subprocess_stdout() -> int:
    return asyncio.subprocess.STDOUT


def parse_runner_metrics(text: str) -> dict[str, float]:
    """The runner's `/metrics` samples the view needs, each summed over its labels."""
    wanted = ("runfleet_inflight_runs", "runfleet_deliveries_total")
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _last_error(path: Path, offset: int) -> str | None:
    """The last `error [code]: message` line (SPEC §10's error output) the process that
    started at `offset` printed: why it ended, for the view and `up`'s log."""
    try:
        with path.open("rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read()
    except FileNotFoundError:
        return None
    found = list(_ERROR_LINE.finditer(tail))
    if not found:
        return None
    code, message = found[-1].group(1).decode(), found[-1].group(2).decode(errors="replace")
    return f"[{code}] {message[:160]}"


def _read_port(path: Path, offset: int = 0) -> int | None:
    """The HTTP port the process started at `offset` of its appended log announced: only
    its own lines are read, so a restarted runner never shows a port an earlier start held."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            head = f.read(65536)
    except FileNotFoundError:
        return None
    match = _PORT_LINE.search(head)
    return int(match.group(1)) if match else None
