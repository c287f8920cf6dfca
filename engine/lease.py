"""The lease keeper (SPEC §5.4): refresh by CAS on the token every interval, read
`cancel_requested` on the same beat, and declare the lease lost only when refreshes kept failing
until `expires_at - loss_margin`. Used by the runner (which adds a working ack to each beat) and
by local executions (`runfleet run`), which are fenced like any other."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from engine.cancel import CancelSignal
from engine.outcome import CancelReason
from store import CasConflict, Eq, RunStore, StoreError, Update, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    ttl: timedelta = timedelta(seconds=30)
    interval: timedelta = timedelta(seconds=10)
    skew: timedelta = timedelta(seconds=2)
    loss_margin: timedelta = timedelta(seconds=5)


Beat = Callable[[], Awaitable[None]]


def held_clock() -> float:
    """Seconds on a clock nobody sets: `CLOCK_BOOTTIME` (it also counts a suspend) where the
    system has one, else the monotonic clock (ADR-0025). The holder judges its lease on this
    clock as well as on the wall clock, and believes the shorter of the two (see
    `LeaseKeeper.seconds_left`)."""
    return time.clock_gettime(_HELD_CLOCK)


_HELD_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class LeaseKeeper:
    def __init__(
        self,
        store: RunStore,
        run_id: str,
        token: str,
        expires_at: datetime,
        timing: LeaseTiming,
        cancel: CancelSignal,
        on_beat: Beat | None = None,
        on_trouble: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.token = token
        self.expires_at = expires_at
        self.timing = timing
        self.cancel = cancel
        self.on_beat = on_beat
        self.on_trouble = on_trouble
        """Told `failed` for each refresh try that failed, `lost` when the lease is lost: the
        runner counts them (only successes were counted, an autoscaling walkthrough)."""
        self.refreshes = 0
        self.last_refresh_s = 0.0
        self._stop = asyncio.Event()
        self._waiter: asyncio.Future[None] | None = None
        now, own = utcnow(), held_clock()
        self._held_until = own + (expires_at - now).total_seconds()
        """`expires_at` on `held_clock`: what this holder believes whatever the wall clock does."""
        self._offset = now.timestamp() - own
        """Wall clock minus own clock at the start or the last refresh: a refresh that finds it
        moved by more than the skew since knows the wall clock was stepped (`_stepped`).
        Re-read at each refresh, so NTP's slewing (up to 0.5 ms a second, 1.8 s an hour)
        never adds up to a step over a long run."""
        cancel.lease_left = self.seconds_left  # what starts work asks it (`lease_spent`)

    def stop(self) -> None:
        self._stop.set()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def seconds_left(self) -> float:
        """Until the loss margin: past it, nothing this execution starts may land.

        The shorter of two readings. `expires_at` is what the store holds and what everyone
        else judges the lease by, on their wall clocks; read on this host's wall clock alone, a
        clock stepped back (NTP, a restored VM) made the holder believe it held a lease others
        saw expire, so two executions ran one run's nodes at once (a clocks review). The
        holder's own reading, on a clock nobody sets, is not fooled by that; a wall clock
        stepped forward still ends the lease early, which is safe: the run is handed on."""
        margin = self.timing.loss_margin.total_seconds()
        wall = (self.expires_at - utcnow()).total_seconds()
        own = self._held_until - held_clock()
        return min(wall, own) - margin

    def held_at_start(self) -> bool:
        """Whether the lease the claim wrote is still short of its loss margin. A claim's
        `expires_at` is counted from before its write, and a write that waited on a busy store
        (another process holding the lock) can land with the lease already past its margin:
        an adopter may take it at any moment, before the first beat could refresh it. Such a
        lease is lost before it was held: the execution must start nothing (SPEC §13.1;
        found by the chaos soak, two executions running one node after a store-fault
        window)."""
        if self.seconds_left() > 0:
            return True
        log.warning(
            "run %s: lease %s landed past its loss margin (the store was slow); not held",
            self.run_id,
            self.token,
        )
        self.cancel.cancel(CancelReason.LEASE_LOST)
        return False

    async def _pause(self, seconds: float) -> bool:
        """Wait `seconds` or until stopped; True when stopped. A future and a timer, not
        `wait_for` over `Event.wait()`: that made two tasks per pause, and most runs are over
        before their first beat (issue 19's profile)."""
        if self._stop.is_set():
            return True
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(max(seconds, 0.0), _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return self._stop.is_set()

    async def run(self) -> None:
        # The first beat comes at a random point in the second half of the interval: runs
        # claimed in a burst (a backlog draining) would otherwise refresh in the same instant
        # every interval, queueing on the store. Earlier than the interval is always safe.
        interval = self.timing.interval.total_seconds()
        # ... and never past half the time left before the margin: a lease that landed late
        # (a slow claim) is refreshed before an adopter could take it.
        pause = min(interval * random.uniform(0.5, 1.0), max(self.seconds_left(), 0.0) / 2)
        while not await self._pause(pause):
            pause = interval
            if not await self.refresh_once():
                return
            if self.on_beat is not None:
                try:
                    await self.on_beat()
                except Exception:
                    log.warning("working ack for run %s failed", self.run_id, exc_info=True)

    async def refresh_once(self) -> bool:
        """One beat. False when the lease is lost (the cancel signal says so)."""
        backoff = 0.05
        while True:
            if (step := self._stepped()) is not None:
                # The expiry this refresh would write comes from a wall clock that jumped:
                # stepped back, it would write an expiry the other hosts already read as
                # expired while this holder believed it held the lease (a review of the
                # clocks fix). The lease is given up; a redelivery takes the run on.
                log.error(
                    "run %s: this host's wall clock was stepped by %+.1fs; lease %s given up",
                    self.run_id,
                    step,
                    self.token,
                )
                self._trouble("lost")
                self.cancel.cancel(CancelReason.LEASE_LOST)
                return False
            wall_now = utcnow()
            new_expiry = wall_now + self.timing.ttl
            sent = held_clock()
            started = time.monotonic()
            # A refresh that never answers must not hold the lease forever: each try is
            # bounded by the time left before the loss margin.
            left = max(self.seconds_left(), 0.0)
            try:
                result = await asyncio.wait_for(
                    self.store.update_run(
                        self.run_id,
                        [Eq("lease.token", self.token)],
                        Update(set={"lease.expires_at": new_expiry}, bump_version=False),
                    ),
                    timeout=min(left, self.timing.interval.total_seconds()) or 0.001,
                )
            except (StoreError, TimeoutError) as exc:
                self._trouble("failed")
                if self.seconds_left() <= 0:
                    log.error("run %s: lease lost, refreshes failed until the margin", self.run_id)
                    self._trouble("lost")
                    self.cancel.cancel(CancelReason.LEASE_LOST)
                    return False
                log.warning("run %s: lease refresh failed (%r); retrying", self.run_id, exc)
                if await self._pause(min(backoff, max(self.seconds_left(), 0.0))):
                    return True
                backoff = min(backoff * 2, 1.0)
                continue
            if isinstance(result, CasConflict):
                if self._stop.is_set():  # the holder let go meanwhile (a folded release)
                    return False
                log.error("run %s: lease %s taken over", self.run_id, self.token)
                self._trouble("lost")
                self.cancel.cancel(CancelReason.LEASE_LOST)
                return False
            self.expires_at = new_expiry
            self._held_until = sent + self.timing.ttl.total_seconds()
            self._offset = wall_now.timestamp() - sent
            self.refreshes += 1
            self.last_refresh_s = time.monotonic() - started
            if result.cancel_requested:
                self.cancel.cancel(CancelReason.OPERATOR)
            return True

    def _stepped(self) -> float | None:
        """How far the wall clock moved against the own clock since the start or the last
        refresh, when that is more than the skew the fleet allows between hosts; else None."""
        drift = (utcnow().timestamp() - held_clock()) - self._offset
        return drift if abs(drift) > self.timing.skew.total_seconds() else None

    def _trouble(self, outcome: str) -> None:
        if self.on_trouble is not None:
            self.on_trouble(outcome)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
