"""An open-loop load: start one call at each scheduled instant, whatever the earlier calls are
doing. Dependency-free, so `docs/bench/*/probe_s16/peer_open_loop.py` drives the peers with this
same schedule from their own virtualenv.

Each call is its own task: a slow call does not delay the schedule, so a system that falls
behind shows it as latency, not as a lower offered rate (a closed loop would hide it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def open_loop(rate: float, seconds: float, call: Callable[[], Awaitable[object]]) -> int:
    """Start `call()` `max(rate x seconds, 1)` times, the i-th at `i / rate` seconds from now,
    and return the count once every call has finished (the first error raised is re-raised
    after all of them ended)."""
    n = max(int(rate * seconds), 1)
    pending: set[asyncio.Task[object]] = set()  # finished calls are dropped, not kept
    failures: list[BaseException] = []

    def settled(task: asyncio.Task[object]) -> None:
        pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task: asyncio.Task[object] = asyncio.ensure_future(call())
        pending.add(task)
        task.add_done_callback(settled)
    while pending:
        await asyncio.wait(pending)
    if failures:
        raise failures[0]
    return n
