"""One `runfleet up` per data dir: an OS lock on `DATA/up.lock` (ADR-0018), and the processes
that hold it when it is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from publisher.config import UP_LOCK_FILE
from runner.operations.errors import FleetAlreadyRunning
from store.settings import SettingProblem, SettingsInvalid


@contextlib.contextmanager
def hold_data_dir(data: Path) -> Iterator[int]:
    """One fleet per data dir: a second `up` would start a second nats-server on the same
    JetStream store, a second sweeper over the same SQLite file, and take `nats.url` from the
    fleet every other command uses. `FleetAlreadyRunning` (exit 3) while another holds it
    (ADR-0018).

    An OS lock, not a pid file: the kernel drops it when the last process holding it ends
    however it ends (SIGKILL too), so a crashed fleet never blocks the next one, and a pid left
    in the file (perhaps reused by an unrelated process) never refuses. Yields the locked fd
    for the fleet's children to inherit (`EmbeddedFleet(lock_fd=...)`): a SIGKILLed `up`
    leaves its nats-server and runners running in their own sessions, and while they run the
    dir is still theirs. The pid is there only to name the holder. The file is never removed:
    a process that opened it just before would lock an inode no one else sees."""
    path = data / UP_LOCK_FILE
    try:
        data.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        # A read-only or foreign data dir: the setting that chose it, not `internal` (found by
        # an operator walkthrough: `error [internal]: OSError(30, ...)`, no path, no remedy).
        raise SettingsInvalid(
            [
                SettingProblem(
                    ("RUNFLEET_DATA",),
                    f"RUNFLEET_DATA={data}: the fleet cannot write there"
                    f" ({exc.strerror or exc}: {exc.filename or path})",
                    "give `up` a directory it may write (`--data DIR` or RUNFLEET_DATA): it"
                    " holds the store, the blobs, the logs and the NATS data",
                )
            ]
        ) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, orphans = _lock_holders(path)
            servers = tuple(p for p in orphans if _is_nats_server(p))
            raise FleetAlreadyRunning(data, pid, orphans, servers=servers) from None
        if stranded := _processes_holding(path, deleted=True):
            # Someone deleted `up.lock` under a running fleet: this lock is on a new inode and
            # proves nothing. The fleet's processes still hold the old one (found by an
            # operator walkthrough: a second `up` then started on the same data dir).
            raise FleetAlreadyRunning(data, None, stranded, lock_deleted=True)
        if unlocked := _servers_on(data):
            # An `up` of a build before this lock ran on the dir (an upgrade walkthrough: the
            # new `up` started a second nats-server on the same JetStream store).
            raise FleetAlreadyRunning(data, None, unlocked, servers=unlocked, unlocked=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield fd
        finally:
            os.ftruncate(fd, 0)  # still locked: no one reads a pid that is about to go
    finally:
        os.close(fd)  # drops the lock, unless a child that outlived us still holds it


def _lock_holders(path: Path) -> tuple[int | None, tuple[int, ...]]:
    """The `up` named in the lock file, or, when it is gone, the processes it left holding
    the lock (found by their open file: Linux `/proc`; elsewhere none are named)."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    pid = int(text) if text.isdigit() else None
    if pid is not None and _alive(pid):
        return pid, ()
    return pid, _processes_holding(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _processes_holding(path: Path, *, deleted: bool = False) -> tuple[int, ...]:
    """Processes with `path` open; with `deleted`, those holding a file once there and since
    deleted (Linux names it `PATH (deleted)`)."""
    target = str(path.resolve()) + (" (deleted)" if deleted else "")
    found: list[int] = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        if fd_dir.parent.name == str(os.getpid()):
            continue  # this process opened it too, to try the lock
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
    # The runners before the nats-servers: stopped in that order, the runners hand their runs
    # off before the server goes (found by an operator walkthrough: the other order left a
    # handoff unpublished until the next fleet's sweeper).
    return tuple(sorted(found, key=lambda pid: (_is_nats_server(pid), pid)))


def _is_nats_server(pid: int) -> bool:
    try:
        return b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _servers_on(data: Path) -> tuple[int, ...]:
    """The nats-servers whose JetStream store (`-sd DIR`, `--store_dir DIR`, or `=DIR`) is
    under `data`, relative to their working directory if it is relative, whoever started
    them (Linux `/proc`; elsewhere none). Only the store's flag counts: a config file or a
    log under a data dir such as `$HOME` is no fleet (a review)."""
    root = data.resolve()
    found: list[int] = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            args = [os.fsdecode(a) for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            if not args or "nats-server" not in Path(args[0]).name:
                continue
            cwd = Path(os.readlink(proc / "cwd"))
            if any((cwd / store).resolve().is_relative_to(root) for store in _store_dirs(args)):
                found.append(int(proc.name))
    return tuple(sorted(found))


def _store_dirs(args: list[str]) -> list[str]:
    found: list[str] = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("-sd", "--sd", "-store_dir", "--store_dir"):
            if eq:
                found.append(value)
            elif i + 1 < len(args):
                found.append(args[i + 1])
    return found
