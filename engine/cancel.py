"""A cancellation signal with a reason, shared by the lease keeper, the control subject, the
drain and the execution. The first reason wins, except that `lease_lost` overrides everything:
once the lease is gone nothing may be written, whatever else was asked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.outcome import CancelReason


class CancelSignal:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason: CancelReason | None = None
        self.lease_left: Callable[[], float] | None = None
        """Seconds the execution's lease has left before its loss margin, on the clock of the
        keeper that holds it (which sets this); None when nothing holds a lease."""

    def cancel(self, reason: CancelReason) -> None:
        if self.reason is None or reason is CancelReason.LEASE_LOST:
            self.reason = reason
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def lease_spent(self) -> bool:
        """Whether the lease has reached its loss margin; if so the signal is cancelled with
        `lease_lost`. The keeper says so only at its beats. A loop that stalled between two
        beats (CPU starvation, a long pause, an await that took its time) can reach the start
        of a node after the margin, when an adopter may already hold the run; fencing would
        refuse the node's writes but not its work. So whatever starts work asks here first
        (SPEC §13.1)."""
        if self.lease_left is None or self.lease_left() > 0:
            return False
        self.cancel(CancelReason.LEASE_LOST)
        return True

    async def wait(self) -> CancelReason:
        await self._event.wait()
        assert self.reason is not None
        return self.reason
