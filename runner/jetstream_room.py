"""Whether a local nats-server's JetStream still has room, and whether a restart would give
it more: what `runfleet up` watches so a disk that filled and was freed again does not leave
the fleet's queue refusing every publish until someone restarts the server by hand.

Two ways a full disk stops JetStream, both measured here on a tmpfs (docs/reliability.md
O27 found the first, under "not fixed"):

- **Its limit.** A server told no `max_file_store` sizes its store once, when it starts: 75 %
  of the disk's free space plus 75 % of what its streams hold (nats-server's `diskAvailable`
  and `finalizeDynamicMaxStore`). Once the streams reach it, every publish is refused
  (`ServiceUnavailable`) while reads, `account_info` and the server's `/healthz` still answer,
  and freeing space does not move the limit: only a restart does.
- **A write the disk refused** (ENOSPC before the limit: another file on the disk grew). The
  stream that met it stops storing for good (publishes time out) and `/healthz` says
  `unavailable` with the write error, until a restart, which recovers the stream.

Both are read from the server's HTTP monitor (`/jsz`, `/healthz`) on 127.0.0.1.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import aiohttp

MiB = 1024 * 1024
FULL_MARGIN = MiB
"""A store with less than this left under its limit refuses the next sizeable publish."""
ROOM_NEEDED = 4 * MiB
"""Room a restart must give beyond what the streams hold, or it would be full again at once."""
GROWTH = 1.1
"""A limit-bound server is restarted only when that raises its limit by at least this factor."""
_ASK_TIMEOUT_S = 2.0
DISK_FULL = "no space left on device"
"""ENOSPC's text in the write error nats-server's `/healthz` reports."""


@dataclass(frozen=True)
class Room:
    stored: int
    """Bytes the server's file streams hold (`/jsz` `storage`)."""
    limit: int
    """The file store's limit (`/jsz` `config.max_storage`; 0 when it did not say)."""
    write_error: str | None = None
    """`/healthz`'s error when a stream met a write the disk refused."""

    @property
    def at_limit(self) -> bool:
        return self.limit > 0 and self.limit - self.stored < FULL_MARGIN

    @property
    def full(self) -> bool:
        return self.at_limit or self.write_error is not None

    def describe(self) -> str:
        if self.write_error is not None:
            return f"JetStream cannot write: {self.write_error}"
        return (
            f"JetStream is full: its streams hold {_mib(self.stored)} of the"
            f" {_mib(self.limit)} it sized itself from the disk's free space when it started"
        )


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


async def read_room(session: aiohttp.ClientSession, monitor_url: str) -> Room | None:
    """The server's room, or None when its monitor does not answer (a server restarting, or
    paused, is the watch's business, not this one's)."""
    timeout = aiohttp.ClientTimeout(total=_ASK_TIMEOUT_S)
    try:
        async with session.get(f"{monitor_url}/jsz", timeout=timeout) as response:
            jsz = await response.json(content_type=None)
        async with session.get(f"{monitor_url}/healthz", timeout=timeout) as response:
            health = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    if not isinstance(jsz, dict) or not isinstance(health, dict):
        return None
    config = jsz.get("config")
    limit = config.get("max_storage", 0) if isinstance(config, dict) else 0
    error = health.get("error")
    # Only the disk's own refusal: a restart mends that once there is room. Other write
    # errors (EIO, EACCES, a read-only remount) would be restarted into again and again.
    write_error = (
        str(error)
        if health.get("status") != "ok" and isinstance(error, str) and DISK_FULL in error
        else None
    )
    return Room(stored=int(jsz.get("storage") or 0), limit=int(limit or 0), write_error=write_error)


def _free(store_dir: Path) -> int:
    try:
        return shutil.disk_usage(store_dir).free
    except OSError:  # the directory is gone or unreadable: no room that a restart could use
        return 0


def limit_after_restart(store_dir: Path, stored: int) -> int:
    """The limit a restart would give the store now (nats-server's own sizing, above)."""
    return _free(store_dir) // 4 * 3 + stored // 4 * 3


def restart_helps(room: Room, store_dir: Path) -> bool:
    """Whether restarting the server now gives its JetStream room to store again."""
    if not room.full:
        return False
    if room.write_error is not None:
        return _free(store_dir) >= ROOM_NEEDED
    after = limit_after_restart(store_dir, room.stored)
    return after >= room.limit * GROWTH and after - room.stored >= ROOM_NEEDED
