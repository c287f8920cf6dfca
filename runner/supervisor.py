"""The one helper that starts background tasks: every task is kept, and its failure surfaces
(no bare `create_task` whose exception nobody reads, STYLE.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class TaskGroup:
    """Keeps handles on its tasks. `loops` crash the owner (via `first_failure`); `deliveries`
    catch their own errors and only need to be awaited at shutdown."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.closing = False
        """Set by the owner's shutdown: from then on a loop that returns is not a failure."""
        self._failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str, critical: bool
    ) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self.tasks.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is None:
                if critical and not self.closing and not self._failed.done():
                    self._failed.set_exception(RuntimeError(f"loop {name} returned"))
                return
            if self.closing:
                log.debug("task %s ended during shutdown: %r", name, exc)
                return
            log.error("task %s failed: %r", name, exc, exc_info=exc)
            if critical and not self._failed.done():
                self._failed.set_exception(exc)

        task.add_done_callback(done)
        return task

    async def first_failure(self) -> None:
        """Returns (raising) when a critical task fails; waits forever otherwise."""
        await self._failed

    def named(self, prefix: str) -> list[asyncio.Task[Any]]:
        return [t for t in self.tasks if t.get_name().startswith(prefix)]

    async def cancel_all(self, grace_s: float) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=grace_s)
