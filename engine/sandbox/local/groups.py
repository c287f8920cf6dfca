"""Process groups of the local driver: which processes are a recorded group, and ending them.

A group is recorded as its pgid (the leader's pid) and the leader's start time, so a recycled
pid is never signalled: a group is ours only while its leader has the recorded start time or,
once the leader is gone, while members started no earlier remain (`group_matches`).

Process facts come from psutil. Start times are kept in clock ticks after boot, the unit of
`/proc/<pid>/stat`: psutil's `create_time()` is wall-clock seconds (boot time + ticks), and a
stepped wall clock (NTP, a leap second) moves the boot time, so comparing wall-clock values
across processes and hours could take our group for a stranger and leave it running. The
difference `create_time() - boot_time()` does not move with the clock; rounded to ticks it is
exact, and records written before psutil was used still compare equal.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass

import psutil

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "GroupRecord",
    "group_matches",
    "process_start_time",
    "signal_group",
    "terminate_groups",
]

DEFAULT_KILL_GRACE_S = 2.0
_POLL_S = 0.01
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class GroupRecord:
    pgid: int
    start_time: int
    """The leader's start, in clock ticks after boot (`process_start_time`)."""


@dataclass(frozen=True, slots=True)
class _Member:
    pid: int
    zombie: bool
    start_time: int


def _member(pid: int) -> _Member | None:
    """The process's facts; None if it is gone (or not ours to read)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            since_boot = proc.create_time() - psutil.boot_time()
            zombie = proc.status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return _Member(pid, zombie, round(since_boot * _TICKS_PER_S))


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot; None if there is no such process."""
    member = _member(pid)
    return None if member is None else member.start_time


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _members(group: GroupRecord) -> list[_Member]:
    leader = _member(group.pgid)
    if leader is not None and leader.start_time != group.start_time:
        return []  # the pid was recycled, so the recorded group no longer exists
    # getpgid is one syscall per pid; the start time is read only for the group's own members.
    in_group = (pid for pid in psutil.pids() if _pgid(pid) == group.pgid)
    members = (_member(pid) for pid in in_group)
    return [m for m in members if m is not None and m.start_time >= group.start_time]


def group_matches(group: GroupRecord) -> bool:
    """True while the recorded group exists and is the one recorded.

    While the leader lives (or is a zombie) its start time must equal the recorded one; a pid
    stays reserved while its group has members, so a leader pid with another start time means
    the group is gone and the number reused. Once the leader is reaped, members started no
    earlier than it are taken as the group (a group whose pid was freed, reused by a new session
    leader that then died too, is indistinguishable, and vanishingly unlikely)."""
    return bool(_members(group))


def _alive(group: GroupRecord) -> bool:
    return any(not m.zombie for m in _members(group))


def signal_group(group: GroupRecord, sig: signal.Signals) -> bool:
    """Send `sig` to the group if it is still the recorded one; False if it was not sent."""
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
    pending = [g for g in groups if signal_group(g, signal.SIGTERM)]
    for sig in (signal.SIGKILL, None):
        deadline = time.monotonic() + grace_s
        while (pending := [g for g in pending if _alive(g)]) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if sig is not None:
            pending = [g for g in pending if signal_group(g, sig)]
