"""The lease an execution holds while it runs (SPEC §5.4): the engine's `LeaseKeeper` refreshes
it by CAS on the token, and on the same beat the runner sends a working ack (`in_progress()`,
which resets the delivery's `ack_wait`) and the keeper reads `cancel_requested`. The execution's
cancel signal is registered for the control subject while the lease is held."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType

from engine.cancel import CancelSignal
from engine.lease import LeaseKeeper
from runner.deliveries import Delivery
from runner.services import RunnerServices
from store import RunDocument


class HeldLease:
    def __init__(
        self, svc: RunnerServices, run: RunDocument, delivery: Delivery, cancel: CancelSignal
    ) -> None:
        assert run.lease is not None
        self.svc = svc
        self.run = run
        self.delivery = delivery
        self.cancel = cancel
        self.token = run.lease.token
        self._last_beat = time.monotonic()
        self.keeper = LeaseKeeper(
            svc.store,
            run.run_id,
            run.lease.token,
            run.lease.expires_at,
            svc.engine.lease_timing(),
            cancel,
            on_beat=self._beat,
        )
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        self.svc.metrics.lease_refresh_latency.observe(self.keeper.last_refresh_s)
        self.svc.metrics.lease_refreshes.labels(outcome="ok").inc()
        self._last_beat = time.monotonic()
        await self.delivery.in_progress()

    async def __aenter__(self) -> HeldLease:
        self.svc.executions[self.run.run_id] = self.cancel
        self._task = asyncio.ensure_future(self.keeper.run())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.keeper.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.svc.executions.get(self.run.run_id) is self.cancel:
            del self.svc.executions[self.run.run_id]
