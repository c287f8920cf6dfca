"""A cancellation signal with a reason, shared by the lease keeper, the control subject, the
drain and the execution. The first reason wins, except that `lease_lost` overrides everything:
once the lease is gone nothing may be written, whatever else was asked."""

from __future__ import annotations

import asyncio

from engine.outcome import CancelReason


class CancelSignal:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason: CancelReason | None = None

    def cancel(self, reason: CancelReason) -> None:
        if self.reason is None or reason is CancelReason.LEASE_LOST:
            self.reason = reason
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> CancelReason:
        await self._event.wait()
        assert self.reason is not None
        return self.reason
