"""Records of started groups: `<data_dir>/sandboxes/<run_id>/<token>.json` (SPEC §7.1).

A record names a sandbox and every live group it started, so anyone on the host can end them:
another execution (`stop_others`, §5.3) or the sandbox's watchdog when the runner died. It is
replaced atomically under a per-run `flock`, so a reader never sees a torn write and two
executions of one run never interleave their edits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engine.sandbox.errors import SandboxRecordCorrupt, SandboxStartFailed
from engine.sandbox.local.groups import GroupRecord

__all__ = [
    "SandboxRecord",
    "check_name",
    "read_record",
    "run_lock",
    "sandbox_name",
    "write_record",
]

_POLL_S = 0.01
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def sandbox_name(run_id: str, token: str) -> str:
    return f"{run_id}-{token}"


def check_name(value: str, what: str) -> None:
    """Refuse a run id or lease token that is not safe as a path component of a record."""
    if not _NAME_RE.fullmatch(value):
        raise SandboxStartFailed(f"{what} {value!r} is not usable in a sandbox name")


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    """The file that lets anyone on the host end a sandbox's groups."""

    run_id: str
    token: str
    groups: tuple[GroupRecord, ...] = ()

    @property
    def name(self) -> str:
        return sandbox_name(self.run_id, self.token)

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


def write_record(path: Path, record: SandboxRecord) -> None:
    # No fsync: the record describes live processes, which a power loss ends anyway.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(record.to_json())
    os.replace(tmp, path)


def _open_lock_file(run_dir: Path) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    return os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.asynccontextmanager
async def run_lock(run_dir: Path) -> AsyncIterator[None]:
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
