"""The one seam the chaos soak puts into its runner processes: it lets the post-engine store fault
(`tests/soak/`) open its window at the instant a run's last node is done and its `finished`
status write is about to go — the write ADR-0010 turns into a nak with no DLQ record when the
store cannot take it (SPEC v2.2 §5.1, §5.6 last row).

Why a seam, and not a window opened on a ledger line: a store outage long enough to make writers
fail (past the 10 s busy timeout) costs every held lease first — with the soak's TTL of 3 s the
keeper gives up at `expires_at - margin`, 1.5-2.5 s in — and between a run's last node and its
status write come the engine's own writes (the boundary checkpoint, `node_finished`), a few
milliseconds apart. A window opened from outside on the `finish` line lands on the checkpoint
write: the execution is fenced at the lease loss and never reaches its status write, so the
post-engine path would go untested.

What the seam does, and nothing else: once the soak has armed it, the first `finished` status
write of the fleet waits (at most `LOCK_WAIT_S`) until the soak's own sqlite3 connection holds
the write lock, then goes to the real store, which refuses it after the busy timeout with the
real `StoreUnavailable`. The write, and everything after it, is the product's.

The handshake is files in `$RUNFLEET_SOAK_SEAM`: the soak creates `armed`; the first such writer
renames it to `caught.<pid>.<run id>` (a rename is atomic: one catch per arming); the soak takes
the lock and creates `locked.<run id>`; the writer sees it and writes.

`python -m tests.soak_seam runner …` is `python -m runner runner …` with the seam installed.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.fencing import FencedWriter
from store import RunDocument, RunStatus

SEAM_ENV = "RUNFLEET_SOAK_SEAM"
ARMED = "armed"
LOCK_WAIT_S = 15.0
"""How long a caught status write waits for the soak's lock before it goes anyway."""
_POLL_S = 0.005


def install(directory: Path) -> None:
    original = FencedWriter.write_status

    async def write_status(self: FencedWriter, status: RunStatus, **kwargs: Any) -> RunDocument:
        if status is RunStatus.FINISHED and _catch(directory, self.run_id):
            locked = directory / f"locked.{self.run_id}"
            for _ in range(int(LOCK_WAIT_S / _POLL_S)):  # another process's file: a poll
                if locked.exists():
                    break
                await asyncio.sleep(_POLL_S)
        return await original(self, status, **kwargs)

    FencedWriter.write_status = write_status  # type: ignore[method-assign]


def _catch(directory: Path, run_id: str) -> bool:
    try:
        os.rename(directory / ARMED, directory / f"caught.{os.getpid()}.{run_id}")
    except FileNotFoundError:
        return False  # not armed, or another writer caught this arming
    return True


@dataclass(frozen=True, slots=True)
class Caught:
    pid: int
    run_id: str


class PostEngineSeam:
    """The soak's side of the handshake."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.iterdir():  # a `--data` directory used before
            stale.unlink()
        self._seen: set[str] = set()

    def arm(self) -> None:
        (self.directory / ARMED).touch()

    def disarm(self) -> bool:
        """True when it was still armed (nothing caught it)."""
        try:
            (self.directory / ARMED).unlink()
        except FileNotFoundError:
            return False
        return True

    async def caught(self, within: float, stop: asyncio.Event) -> Caught | None:
        """The writer that caught this arming, or None after `within` s (or at `stop`)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not stop.is_set():
            for path in self.directory.glob("caught.*"):
                if path.name in self._seen:
                    continue
                self._seen.add(path.name)
                _, pid, run_id = path.name.split(".", 2)
                return Caught(int(pid), run_id)
            await asyncio.sleep(_POLL_S)
        return None

    def locked(self, run_id: str) -> None:
        (self.directory / f"locked.{run_id}").touch()


if __name__ == "__main__":
    install(Path(os.environ[SEAM_ENV]))
    from runner.cli.main import cli

    cli()
