"""The lease an execution holds while it runs (SPEC §5.4): the engine's `LeaseKeeper` refreshes
it by CAS on the token, and on the same beat the runner sends a working ack (`in_progress()`,
which resets the delivery's `ack_wait`) and the keeper reads `cancel_requested`. The execution's
cancel signal is registered for the control subject while the lease is held."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType

import nats.errors

from engine.cancel import CancelSignal
from engine.lease import LeaseKeeper
from runner.deliveries import Delivery
from runner.services import RunnerServices
from store import RunDocument

log = logging.getLogger(__name__)


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
            svc.lease,
            cancel,
            on_beat=self._beat,
            on_trouble=self._trouble,
        )
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        self.svc.metrics.lease_refresh_latency.observe(self.keeper.last_refresh_s)
        self.svc.metrics.child(self.svc.metrics.lease_refreshes, "ok").inc()
        self._last_beat = time.monotonic()
        await self.delivery.in_progress()

    def _trouble(self, outcome: str) -> None:
        """A refresh try that failed (`failed`), or the lease lost (`lost`)."""
        self.svc.metrics.child(self.svc.metrics.lease_refreshes, outcome).inc()

    async def __aenter__(self) -> HeldLease:
        if not self.keeper.held_at_start():
            # No working ack (the delivery redelivers after `ack_wait`, to an adopter), no
            # keeper, no registration: the execution starts nothing (`delivery._run`).
            return self
        # The claim's working ack. JetStream counts `ack_wait` (TTL + skew) from the delivery,
        # but the lease's `expires_at` counts TTL from admission's `now`, which comes later
        # (fetch, dispatch, the run's read). Without this, a runner that dies before its first
        # refresh leaves a redelivery that can land before its lease is free, and the adopter
        # naks it for a whole lease interval (SPEC §5.2 step 5). Restarting `ack_wait` here,
        # after the claim's CAS, puts the redelivery after `expires_at + skew`. Fire-and-forget
        # like every beat's: a lost one costs at most the interval it was meant to save.
        try:
            await self.delivery.in_progress()
        except nats.errors.Error as exc:
            log.warning("run %s: the claim's working ack failed: %s", self.run.run_id, exc)
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
