"""The `local` sandbox driver: commands are subprocesses of the runner (SPEC §7.1).

Each command runs as `/bin/sh -c <command>` in a new session, so it leads its own process group;
when it ends, times out or the sandbox stops, the whole group is ended (SIGTERM, then SIGKILL
after a grace), so a background child (`sleep 300 &`) never outlives its node. Every live group
is recorded with its pgid and its leader's start time (field 22 of `/proc/<pid>/stat`) in
`<data_dir>/sandboxes/<run_id>/<token>.json`, written atomically under a per-run `flock`, so:

- another execution, in any process on this host, can end them (`stop_others`, §5.3);
- a per-sandbox watchdog process (`python -m engine.sandbox.watchdog <record>`) that holds the read
  end of a pipe from the runner ends them when the pipe reaches EOF: the runner died, even by
  SIGKILL. A normal `stop()` ends the groups and removes the record before closing the pipe;
- a recycled pid is never signalled: a group is ours only while its leader has the recorded start
  time or, once the leader is gone, while members started no earlier remain (`group_matches`).

A command is held at a gate (`read` on its stdin) until its group is recorded, so a group never
runs unrecorded; if the runner dies before opening the gate, the command exits without running.
Its stdin is then `/dev/null`.

What escapes, on purpose and documented:
- a process that leaves its process group (`setsid`, `setpgid`) is no longer tracked or killed,
  and if it keeps the command's stdout/stderr open its output is cut off after the grace;
- the command env is `spec.env` plus a few host variables (`PATH`, `HOME`, `LANG`, ...), and
  `RUNFLEET_SCRATCH_DIR` / `RUNFLEET_WORKSPACE` (/ `RUNFLEET_ATTACHMENTS_DIR`); nothing else of the
  runner's env leaks in. The driver isolates nothing else (`process_isolated=False`);
- a runner that forks without exec keeps the watchdog's pipe open in the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, replace
from pathlib import Path

from engine.sandbox.errors import (
    SandboxArchiveInvalid,
    SandboxCopyFailed,
    SandboxLost,
    SandboxRecordCorrupt,
    SandboxSetupTimeout,
    SandboxStartFailed,
)
from engine.sandbox.protocols import (
    OUTPUT_CHUNK_BYTES,
    OUTPUT_TAIL_BYTES,
    ExecResult,
    OutputCallback,
    SandboxCapabilities,
    SandboxRef,
    SandboxSpec,
)

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "GroupRecord",
    "LocalSandbox",
    "LocalSandboxDriver",
    "SandboxRecord",
    "group_matches",
    "process_start_time",
    "read_record",
    "terminate_groups",
]

DEFAULT_KILL_GRACE_S = 2.0
_PROC = Path("/proc")
_POLL_S = 0.01
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HOST_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR")
# $1 is the command; it runs only after the runner wrote "go", i.e. after its group is recorded.
_GATE = 'IFS= read -r gate && [ "$gate" = go ] && exec /bin/sh -c "$1" </dev/null'
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_CAPABILITIES = SandboxCapabilities(
    process_isolated=False, host_backed_scratch=True, supports_dir_copy=True
)


# --- processes and groups -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stat:
    pid: int
    state: str
    pgrp: int
    start_time: int


def _read_stat(pid: int) -> _Stat | None:
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) is parenthesised and may hold spaces or ')': split after the last ')'.
    rest = raw[raw.rindex(b")") + 2 :].split()
    return _Stat(pid, rest[0].decode(), int(rest[2]), int(rest[19]))  # fields 3, 5, 22


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot; None if there is no such process."""
    stat = _read_stat(pid)
    return None if stat is None else stat.start_time


@dataclass(frozen=True, slots=True)
class GroupRecord:
    pgid: int
    start_time: int


def _members(group: GroupRecord) -> list[_Stat]:
    leader = _read_stat(group.pgid)
    if leader is not None and leader.start_time != group.start_time:
        return []  # the pid was recycled, so the recorded group no longer exists
    stats = (_read_stat(int(n)) for n in os.listdir(_PROC) if n.isdigit())
    return [s for s in stats if s and s.pgrp == group.pgid and s.start_time >= group.start_time]


def group_matches(group: GroupRecord) -> bool:
    """True while the recorded group exists and is the one recorded.

    While the leader lives (or is a zombie) its start time must equal the recorded one; a pid
    stays reserved while its group has members, so a leader pid with another start time means
    the group is gone and the number reused. Once the leader is reaped, members started no
    earlier than it are taken as the group (a group whose pid was freed, reused by a new session
    leader that then died too, is indistinguishable, and vanishingly unlikely)."""
    return bool(_members(group))


def _alive(group: GroupRecord) -> bool:
    return any(s.state != "Z" for s in _members(group))


def _signal(group: GroupRecord, sig: signal.Signals) -> bool:
    if not group_matches(group):
        return False
    try:
        os.killpg(group.pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def terminate_groups(groups: Collection[GroupRecord], grace_s: float) -> None:
    """End every group that is still the recorded one: SIGTERM, then SIGKILL to those alive
    after `grace_s`, then wait up to `grace_s` for them to die. Blocking; never raises for a
    group that is already gone."""
    pending = [g for g in groups if _signal(g, signal.SIGTERM)]
    for sig in (signal.SIGKILL, None):
        deadline = time.monotonic() + grace_s
        while (pending := [g for g in pending if _alive(g)]) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if sig is not None:
            pending = [g for g in pending if _signal(g, sig)]


# --- records ----------------------------------------------------------------------------------


def _sandbox_name(run_id: str, token: str) -> str:
    return f"{run_id}-{token}"


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    """The file that lets anyone on the host end a sandbox's groups."""

    run_id: str
    token: str
    groups: tuple[GroupRecord, ...] = ()

    @property
    def name(self) -> str:
        return _sandbox_name(self.run_id, self.token)

    def to_json(self) -> bytes:
        groups = [{"pgid": g.pgid, "start_time": g.start_time} for g in self.groups]
        doc = {"version": 1, "run_id": self.run_id, "token": self.token, "name": self.name}
        return json.dumps({**doc, "runner_pid": os.getpid(), "groups": groups}).encode()


def read_record(path: Path) -> SandboxRecord | None:
    """The record at `path`, None if there is none; `SandboxRecordCorrupt` if it does not
    parse (records are replaced atomically, so this is not a torn write)."""
    try:
        doc = json.loads(path.read_bytes())
        groups = tuple(GroupRecord(int(g["pgid"]), int(g["start_time"])) for g in doc["groups"])
        return SandboxRecord(str(doc["run_id"]), str(doc["token"]), groups)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SandboxRecordCorrupt(f"sandbox record {path} is unreadable: {e}") from e


def _write_record(path: Path, record: SandboxRecord) -> None:
    # No fsync: the record describes live processes, which a power loss ends anyway.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(record.to_json())
    os.replace(tmp, path)


def _open_lock_file(run_dir: Path) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    return os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.asynccontextmanager
async def _run_lock(run_dir: Path) -> AsyncIterator[None]:
    """An exclusive `flock` on the run's directory, shared by every process on the host.
    Polled rather than blocking, so a waiter can be cancelled and never blocks the loop."""
    fd = _open_lock_file(run_dir)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _check_name(value: str, what: str) -> None:
    if not _NAME_RE.fullmatch(value):
        raise SandboxStartFailed(f"{what} {value!r} is not usable in a sandbox name")


# --- the driver -----------------------------------------------------------------------------


class LocalSandboxDriver:
    """Sandboxes as process groups on this host, recorded under `<data_dir>/sandboxes/`."""

    def __init__(self, data_dir: Path, *, kill_grace_s: float = DEFAULT_KILL_GRACE_S) -> None:
        self._root = Path(data_dir).absolute() / "sandboxes"
        self._grace = kill_grace_s

    @property
    def capabilities(self) -> SandboxCapabilities:
        return _CAPABILITIES

    def record_path(self, run_id: str, token: str) -> Path:
        return self._root / run_id / f"{token}.json"

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        _check_name(spec.run_id, "run id")
        _check_name(spec.lease_token, "lease token")
        spec = replace(
            spec,
            workspace_dir=spec.workspace_dir.absolute(),
            scratch_dir=spec.scratch_dir.absolute(),
            attachments_dir=spec.attachments_dir and spec.attachments_dir.absolute(),
        )
        try:
            spec.workspace_dir.mkdir(parents=True, exist_ok=True)
            spec.scratch_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SandboxStartFailed(f"cannot create the sandbox directories: {e}") from e
        path = self.record_path(spec.run_id, spec.lease_token)
        async with _run_lock(path.parent):
            if path.exists():
                raise SandboxStartFailed(f"sandbox {path.stem} of run {spec.run_id} exists")
            _write_record(path, SandboxRecord(spec.run_id, spec.lease_token))
        try:
            watchdog = await _start_watchdog(path, self._grace, spec.setup_timeout_s)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return LocalSandbox(spec, path, watchdog, self._grace)

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        run_dir = self._root / run_id
        if not run_dir.is_dir():
            return []
        async with _run_lock(run_dir):
            paths = [p for p in sorted(run_dir.glob("*.json")) if p.stem != keep_token]
            records = [(p, r) for p in paths if (r := read_record(p)) is not None]
            groups = [g for _, r in records for g in r.groups]
            await asyncio.to_thread(terminate_groups, groups, self._grace)
            for path, _ in records:
                path.unlink(missing_ok=True)
        return [r.name for _, r in records]

    async def list_sandboxes(self) -> list[SandboxRef]:
        if not self._root.is_dir():
            return []
        paths = sorted(self._root.glob("*/*.json"))
        return [
            SandboxRef(p.parent.name, p.stem, _sandbox_name(p.parent.name, p.stem)) for p in paths
        ]


async def _start_watchdog(
    record: Path, grace_s: float, timeout_s: float
) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    try:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "engine.sandbox.watchdog", str(record), str(grace_s)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # a ^C to the runner's group must not reach it first
            cwd="/",
            env=env,
        )
    except OSError as e:
        raise SandboxStartFailed(f"cannot start the sandbox watchdog: {e}") from e
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(timeout_s):
            ready = await proc.stdout.readline()
    except BaseException as e:
        await _kill_process(proc)
        if isinstance(e, TimeoutError):
            raise SandboxSetupTimeout(f"the watchdog was not ready in {timeout_s}s") from e
        raise
    if ready != b"ready\n":
        await _kill_process(proc)
        raise SandboxStartFailed("the sandbox watchdog exited at start (see the runner's stderr)")
    return proc


async def _kill_process(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    if proc.stdin is not None:
        proc.stdin.close()
    await proc.wait()


class _Tail:
    def __init__(self) -> None:
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        del self.data[:-OUTPUT_TAIL_BYTES]


async def _pump(
    name: str, reader: asyncio.StreamReader, tail: _Tail, on_output: OutputCallback | None
) -> None:
    while chunk := await reader.read(OUTPUT_CHUNK_BYTES):
        tail.add(chunk)
        if on_output is not None:
            await on_output(name, chunk)


async def _open_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=OUTPUT_CHUNK_BYTES, loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
        )
    except BaseException:
        pipe.close()
        raise
    return reader, transport


class LocalSandbox:
    """One execution's sandbox; made by `LocalSandboxDriver.start`."""

    def __init__(
        self,
        spec: SandboxSpec,
        record_path: Path,
        watchdog: asyncio.subprocess.Process,
        kill_grace_s: float,
    ) -> None:
        self.spec = spec
        self.record_path = record_path
        self._watchdog = watchdog
        self._grace = kill_grace_s
        self._live: dict[int, GroupRecord] = {}
        self._stopping = False
        self._stopped = False
        self._stop_lock = asyncio.Lock()
        self._env = {k: os.environ[k] for k in _HOST_ENV if k in os.environ}
        self._env.update(spec.env)
        self._env["RUNFLEET_SCRATCH_DIR"] = str(spec.scratch_dir)
        self._env["RUNFLEET_WORKSPACE"] = str(spec.workspace_dir)
        if spec.attachments_dir is not None:
            self._env["RUNFLEET_ATTACHMENTS_DIR"] = str(spec.attachments_dir)

    @property
    def name(self) -> str:
        return _sandbox_name(self.spec.run_id, self.spec.lease_token)

    async def exec(
        self, command: str, *, timeout_s: float, on_output: OutputCallback | None = None
    ) -> ExecResult:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        unowned = [out_r, err_r]
        readers: list[tuple[asyncio.StreamReader, asyncio.BaseTransport]] = []
        try:
            while unowned:
                readers.append(await _open_reader(unowned.pop(0)))  # it owns the fd now
            proc, group = await self._spawn(command, stdout=out_w, stderr=err_w)
        except BaseException:
            for fd in unowned:
                os.close(fd)
            for _, transport in readers:
                transport.close()
            raise
        finally:
            os.close(out_w)  # the command holds its own copies
            os.close(err_w)
        started = time.monotonic()
        tails = (_Tail(), _Tail())
        timed_out = False
        duration = 0.0
        ended = False
        try:
            async with asyncio.TaskGroup() as tasks:
                pumps = [
                    tasks.create_task(_pump(name, reader, tail, on_output))
                    for name, (reader, _), tail in zip(
                        ("stdout", "stderr"), readers, tails, strict=True
                    )
                ]
                try:
                    async with asyncio.timeout(timeout_s):
                        await proc.wait()
                except TimeoutError:
                    timed_out = True
                duration = time.monotonic() - started
                await asyncio.to_thread(terminate_groups, [group], self._grace)  # node end
                ended = True
                await proc.wait()
                # The pipes close when every holder has exited; one that left the group keeps
                # them open, so the rest of its output is cut off after the grace.
                _, late = await asyncio.wait(pumps, timeout=self._grace)
                for task in late:
                    task.cancel()
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # only `on_output` fails in there
        finally:
            if not ended:
                _signal(group, signal.SIGKILL)  # cancelled or failed: no grace, no await
            for _, transport in readers:
                transport.close()
        await self._forget(group)
        assert proc.returncode is not None
        return ExecResult(
            exit_code=proc.returncode,
            timed_out=timed_out,
            stdout_tail=bytes(tails[0].data),
            stderr_tail=bytes(tails[1].data),
            duration_s=duration,
        )

    async def _spawn(
        self, command: str, *, stdout: int, stderr: int
    ) -> tuple[asyncio.subprocess.Process, GroupRecord]:
        async with _run_lock(self.record_path.parent):
            record = None if self._stopping else read_record(self.record_path)
            if record is None:
                raise SandboxLost(f"sandbox {self.name} was stopped")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *("/bin/sh", "-c", _GATE, "runfleet-sandbox", command),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=stdout,
                    stderr=stderr,
                    cwd=self.spec.workspace_dir,
                    env=self._env,
                    start_new_session=True,
                )
            except OSError as e:
                raise SandboxLost(f"cannot run a command in sandbox {self.name}: {e}") from e
            assert proc.stdin is not None
            try:
                start_time = process_start_time(proc.pid)
                if start_time is None:
                    raise SandboxLost(f"the command of sandbox {self.name} died at the gate")
                group = GroupRecord(proc.pid, start_time)
                self._live[group.pgid] = group
                try:
                    _write_record(self.record_path, replace(record, groups=(*record.groups, group)))
                except OSError as e:
                    raise SandboxLost(f"cannot record sandbox {self.name}: {e}") from e
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            finally:
                proc.stdin.close()  # without "go" the gate exits without running the command
        return proc, group

    async def _forget(self, group: GroupRecord) -> None:
        async with _run_lock(self.record_path.parent):
            self._live.pop(group.pgid, None)
            record = None if self._stopping else read_record(self.record_path)
            if record is None:
                raise SandboxLost(f"sandbox {self.name} was stopped while a command ran")
            groups = tuple(g for g in record.groups if g != group)
            _write_record(self.record_path, replace(record, groups=groups))

    async def copy_out(self, src: Path, dest_tar: Path) -> None:
        await asyncio.to_thread(_write_tar, self.spec.workspace_dir / src, dest_tar)

    async def copy_in(self, tar: Path, dest_dir: Path) -> None:
        await asyncio.to_thread(_extract_tar, tar, self.spec.workspace_dir / dest_dir)

    async def stop(self) -> None:
        async with self._stop_lock:
            if self._stopped:
                return
            self._stopping = True
            async with _run_lock(self.record_path.parent):
                try:
                    record = read_record(self.record_path)
                except SandboxRecordCorrupt:
                    record = None  # what we started is also in self._live
                groups = {*(record.groups if record else ()), *self._live.values()}
                await asyncio.to_thread(terminate_groups, groups, self._grace)
                self.record_path.unlink(missing_ok=True)
            # Only now: the watchdog reads the record at EOF, and there is none left.
            assert self._watchdog.stdin is not None
            self._watchdog.stdin.close()
            try:
                async with asyncio.timeout(self._grace + 5.0):
                    await self._watchdog.wait()
            except TimeoutError:
                await _kill_process(self._watchdog)
            self._stopped = True


def _write_tar(src: Path, dest: Path) -> None:
    try:
        if not src.is_dir():
            raise SandboxCopyFailed(f"{src} is not a directory")
        with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
    except (OSError, tarfile.TarError) as e:
        dest.unlink(missing_ok=True)
        raise SandboxCopyFailed(f"cannot archive {src} into {dest}: {e}") from e


def _extract_tar(tar_path: Path, dest: Path) -> None:
    try:
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar_path, "r:*") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError) as e:
        raise SandboxArchiveInvalid(f"{tar_path} does not extract into {dest}: {e}") from e
    except OSError as e:
        raise SandboxCopyFailed(f"cannot extract {tar_path} into {dest}: {e}") from e
