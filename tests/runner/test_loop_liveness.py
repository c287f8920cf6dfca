"""The sweeper and the DLQ backstop say they are alive (SPEC §5.8 metrics, §5.9, §5.6's
backstop): each stamps the time it last finished a turn, so an alert can tell a fleet whose
sweeper or backstop stopped — wedged on a call that never returns, or every pass failing —
from one with nothing to do (the last pass's "not expressible with today's metrics")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from runner.backstop import Backstop
from runner.sweeper import LOCK, Sweeper
from store import RunStore, StoreUnavailable, utcnow
from tests.runner.callables import bound_drain, idle_runner, sample
from tests.runner.conftest import Fleet, eventually

PASSES = "runfleet_sweeper_passes_total"
LAST_PASS = "runfleet_sweeper_last_pass_timestamp_seconds"
LAST_POLL = "runfleet_backstop_last_poll_timestamp_seconds"


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


class Wedged:
    """The real store, but `method` never returns from its `after + 1`-th call on (a hung
    connection)."""

    def __init__(self, inner: RunStore, method: str, after: int) -> None:
        self.inner = inner
        self.method = method
        self.after = after
        self.entered = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        async def hang_later(*args: Any, **kwargs: Any) -> Any:
            if self.after > 0:
                self.after -= 1
                return await attr(*args, **kwargs)
            self.entered.set()
            await asyncio.Event().wait()

        return hang_later


class Down:
    """The real store, but taking the sweeper's lock fails as an outage does."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner
        self.tries = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def try_lock(self, *args: Any) -> bool:
        self.tries += 1
        raise StoreUnavailable("the store is down (test)")


@contextlib.asynccontextmanager
async def running(coro: Any) -> AsyncIterator[asyncio.Task[None]]:
    task: asyncio.Task[None] = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_sweeper_liveness_a_finished_pass_is_counted_swept_and_stamped(
    fleet: Fleet,
) -> None:
    before = time.time()
    runner = await idle_runner(fleet, owner="sweeps", sweeper=True)
    registry = runner.metrics.registry

    async def swept() -> float:
        return sample(registry, PASSES, outcome="swept")

    await eventually(swept, within=15)
    assert sample(registry, LAST_PASS) >= before


async def test_sweeper_liveness_a_runner_another_out_elects_counts_not_elected_and_no_stamp(
    fleet: Fleet,
) -> None:
    assert await fleet.store.try_lock(LOCK, "someone-else", utcnow(), 3600)
    runner = await idle_runner(fleet, owner="not-elected", sweeper=True)
    registry = runner.metrics.registry

    async def passed_over() -> float:
        return sample(registry, PASSES, outcome="not_elected")

    await eventually(passed_over, within=15)
    assert sample(registry, LAST_PASS) == 0
    assert sample(registry, PASSES, outcome="swept") == 0


async def test_sweeper_liveness_a_pass_the_store_refuses_is_counted_skipped_and_not_stamped(
    fleet: Fleet,
) -> None:
    runner = await idle_runner(fleet, owner="skips")
    down = Down(fleet.store)
    sweeper = Sweeper(dataclasses.replace(runner.svc, store=down))
    registry = runner.metrics.registry

    async def skipped() -> float:
        return sample(registry, PASSES, outcome="skipped")

    async with running(sweeper.loop()) as task:
        await eventually(skipped, within=15)
        assert not task.done()
    assert down.tries >= 1
    assert sample(registry, LAST_PASS) == 0


async def test_sweeper_liveness_a_pass_wedged_on_the_store_leaves_the_stamp_where_it_was(
    fleet: Fleet,
) -> None:
    runner = await idle_runner(fleet, owner="wedged")
    wedged = Wedged(fleet.store, "list_run_copies", after=1)  # one page: the first pass ends
    quick = fleet.wire.model_copy(update={"sweeper_interval": timedelta(seconds=0.05)})
    svc = dataclasses.replace(runner.svc, store=wedged, wire=quick)
    registry = runner.metrics.registry
    before = time.time()
    async with running(Sweeper(svc).loop()):
        await asyncio.wait_for(wedged.entered.wait(), timeout=10)
        stamp = sample(registry, LAST_PASS)
        assert stamp >= before  # the first pass finished and stamped
        # The second pass took its lock and hangs: no count and no stamp before it finishes.
        assert sample(registry, PASSES, outcome="swept") == 1
        assert sample(registry, LAST_PASS) == stamp


async def test_backstop_liveness_each_finished_pull_stamps_the_time(fleet: Fleet) -> None:
    before = time.time()
    runner = await idle_runner(fleet, owner="backstop-polls", backstop=True)
    registry = runner.metrics.registry

    async def polled() -> float:
        value = sample(registry, LAST_POLL)
        return value if value >= before else 0.0

    first = await eventually(polled, within=15)

    async def again() -> float:
        value = sample(registry, LAST_POLL)
        return value if value > first else 0.0

    await eventually(again, within=15)  # it goes on stamping while nothing waits


class Recording:
    """The backstop's real pull subscription, noting when a pull that delivered returned."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.delivered_at: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:
        msgs = await self.inner.fetch(*args, **kwargs)
        if msgs:
            self.delivered_at = time.time()
        return msgs


async def test_backstop_liveness_an_advisory_whose_settle_never_returns_stops_the_stamp(
    fleet: Fleet,
) -> None:
    runner = await idle_runner(fleet, owner="backstop-wedged")
    backstop = Backstop(runner.svc)
    pulls = Recording(await backstop.subscribe())
    backstop.psub = pulls
    registry = runner.metrics.registry
    seen: list[float] = []

    async def hang(adv: Any) -> str:
        seen.append(sample(registry, LAST_POLL))
        await asyncio.Event().wait()
        return "never"

    backstop.settle_advisory = hang  # type: ignore[method-assign]

    async def stamped() -> float:
        return sample(registry, LAST_POLL)

    async with running(backstop.loop()):
        await eventually(stamped, within=15)  # empty pulls stamp
        await fleet.js.publish(
            fleet.names.advisory_subject,
            json.dumps({"stream_seq": 1}).encode(),
            stream=fleet.names.advisory_stream,
        )

        async def settling() -> bool:
            return bool(seen)

        await eventually(settling, within=15)
        assert pulls.delivered_at is not None
        # The pull that delivered the advisory did not stamp before its settle: the stamp
        # is an earlier, empty pull's, and a settle that never returns stops it there.
        assert 0 < seen[0] < pulls.delivered_at
        assert sample(registry, LAST_POLL) == seen[0]
    await pulls.unsubscribe()
