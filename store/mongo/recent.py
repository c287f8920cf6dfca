"""What this process knows about the runs it appended events to: the last `seq` it saw (the
next append's first guess) and a lock that queues this process's appenders to one run."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class RecentRun:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_seq: int | None = None


class RecentRuns:
    """LRU-bounded; evicting a run that is still appending costs only a collision."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._runs: OrderedDict[str, RecentRun] = OrderedDict()

    def get(self, run_id: str) -> RecentRun:
        recent = self._runs.pop(run_id, None) or RecentRun()
        self._runs[run_id] = recent
        if len(self._runs) > self._size:
            self._runs.popitem(last=False)
        return recent

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
