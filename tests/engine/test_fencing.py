"""Fencing (SPEC §2 write conditions, §5.4, invariant §13.1): an execution that lost its lease
writes nothing more — not its checkpoint, not its status, not its events.

The steal is what an adopter's claim does to the run: one CAS that puts another token in
`lease.token`. The tests compare the run document and the event count read right after the steal
with what is there once the stale execution has stopped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.events import EventLog
from engine.execution import Execution
from engine.fencing import FencedWriter, LeaseLost
from engine.lease import LeaseKeeper
from engine.loader import LoadedWorkflow
from engine.outcome import CancelReason, Interrupted
from store import (
    Checkpoint,
    Eq,
    Event,
    RunDocument,
    RunStatus,
    RunStore,
    StoreUnavailable,
    Update,
)
from tests.engine import callables

Load = Callable[[str], LoadedWorkflow]
Events = Callable[[str], Awaitable[list[Event]]]
Claim = Callable[..., Awaitable[tuple[RunDocument, str]]]

DEADLINE_S = 15.0


async def steal(store: RunStore, run: RunDocument, token: str) -> RunDocument:
    """Another execution takes the run: one CAS on the token read, as a claim does."""
    stolen = await store.update_run(
        run.run_id,
        [Eq("lease.token", token)],
        Update(set={"lease.token": f"thief-{uuid.uuid4().hex}", "lease.owner": "thief"}),
    )
    assert isinstance(stolen, RunDocument)
    return stolen


def execution_for(
    store: RunStore,
    run: RunDocument,
    token: str,
    cancel: CancelSignal,
    tmp_path: Path,
    settings: EngineSettings | None = None,
) -> Execution:
    from engine.sandbox.local import LocalSandboxDriver

    return Execution(
        store=store,
        run=run,
        token=token,
        driver=LocalSandboxDriver(tmp_path),
        settings=settings or EngineSettings(),
        cancel=cancel,
        data_dir=tmp_path,
    )


async def test_lost_lease_stops_the_execution_before_its_next_write(
    store: RunStore, load: Load, events: Events, claim: Claim, tmp_path: Path
) -> None:
    """No keeper beat falls inside the node here: the execution learns of the loss only from
    its own next write, which must be refused, and nothing it does after the steal lands."""
    run, token = await claim(load("gate"))
    cancel = CancelSignal()
    execution = execution_for(store, run, token, cancel, tmp_path)
    gate = callables.gate(run.run_id)
    task = asyncio.ensure_future(execution.run())
    try:
        await asyncio.wait_for(gate.entered.wait(), DEADLINE_S)
        stolen = await steal(store, run, token)
        events_at_steal = len(await events(run.run_id))

        gate.release.set()
        outcome = await asyncio.wait_for(task, DEADLINE_S)
    finally:
        task.cancel()

    assert outcome == Interrupted(CancelReason.LEASE_LOST)
    assert cancel.reason is CancelReason.LEASE_LOST
    after = await store.get_run(run.run_id)
    assert after.version == stolen.version
    assert after.checkpoint == stolen.checkpoint
    assert after.status is RunStatus.RUNNING
    assert after.lease == stolen.lease
    log = await events(run.run_id)
    assert [e.type for e in log[events_at_steal:]] == []


async def test_a_keeper_that_finds_its_lease_taken_cancels_the_node_and_writes_nothing(
    store: RunStore,
    load: Load,
    events: Events,
    claim: Claim,
    tmp_path: Path,
    fast_lease: EngineSettings,
) -> None:
    run, token = await claim(load("gate"), settings=fast_lease)
    assert run.lease is not None
    cancel = CancelSignal()
    execution = execution_for(store, run, token, cancel, tmp_path, fast_lease)
    keeper = LeaseKeeper(
        store, run.run_id, token, run.lease.expires_at, fast_lease.lease_timing(), cancel
    )
    keeper_task = asyncio.ensure_future(keeper.run())
    gate = callables.gate(run.run_id)
    task = asyncio.ensure_future(execution.run())
    try:
        await asyncio.wait_for(gate.entered.wait(), DEADLINE_S)
        stolen = await steal(store, run, token)
        events_at_steal = len(await events(run.run_id))

        outcome = await asyncio.wait_for(task, DEADLINE_S)
        await asyncio.wait_for(keeper_task, DEADLINE_S)
    finally:
        task.cancel()
        keeper.stop()
        keeper_task.cancel()

    assert outcome == Interrupted(CancelReason.LEASE_LOST)
    assert not gate.release.is_set()
    after = await store.get_run(run.run_id)
    assert after.version == stolen.version
    assert after.checkpoint == stolen.checkpoint
    assert after.lease == stolen.lease
    log = await events(run.run_id)
    assert [e.type for e in log[events_at_steal:]] == []


async def test_a_node_starts_only_while_the_lease_is_short_of_its_loss_margin(
    store: RunStore,
    load: Load,
    events: Events,
    claim: Claim,
    tmp_path: Path,
    fast_lease: EngineSettings,
) -> None:
    """SPEC §13.1. A stalled loop: the keeper never beats (it is built, never run), and the
    lease's time runs past its loss margin while `hold` works. An adopter may take the run from
    then on, and fencing would refuse only the stale execution's writes, not its work: the next
    node must not start. The execution ends as one that lost its lease."""
    run, token = await claim(load("gate"), settings=fast_lease)
    assert run.lease is not None
    cancel = CancelSignal()
    execution = execution_for(store, run, token, cancel, tmp_path, fast_lease)
    keeper = LeaseKeeper(
        store, run.run_id, token, run.lease.expires_at, fast_lease.lease_timing(), cancel
    )
    gate = callables.gate(run.run_id)
    task = asyncio.ensure_future(execution.run())
    try:
        await asyncio.wait_for(gate.entered.wait(), DEADLINE_S)
        assert keeper.seconds_left() > 0  # `hold` started inside the lease
        deadline = time.monotonic() + DEADLINE_S
        while keeper.seconds_left() > 0:  # the lease's time passes, no beat
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        gate.release.set()
        outcome = await asyncio.wait_for(task, DEADLINE_S)
    finally:
        task.cancel()

    assert outcome == Interrupted(CancelReason.LEASE_LOST)
    assert cancel.reason is CancelReason.LEASE_LOST
    after = await store.get_run(run.run_id)
    assert after.checkpoint is not None
    assert "hold" in after.checkpoint.completed
    assert "after" not in after.checkpoint.outputs
    assert after.status is RunStatus.RUNNING  # nothing settled: an adopter resumes at `after`
    assert after.checkpoint.restart_node == "after"
    log = await events(run.run_id)
    assert ("node_started", "after") not in [(e.type, e.data.get("node")) for e in log]


async def test_fenced_writer_refuses_every_write_after_loss(
    store: RunStore, load: Load, claim: Claim
) -> None:
    run, token = await claim(load("gate"))
    cancel = CancelSignal()
    writer = FencedWriter(store, run.run_id, token, run.attempt, cancel)
    checkpoint = Checkpoint(restart_node="hold", progress=1)
    written = await writer.write_checkpoint(checkpoint)
    assert written.checkpoint == checkpoint

    await steal(store, run, token)
    with pytest.raises(LeaseLost):
        await writer.write_checkpoint(Checkpoint(restart_node="after", progress=2))
    assert cancel.reason is CancelReason.LEASE_LOST

    # Hand the token back: the store would now accept every write below, so a refusal can only
    # come from the writer itself, without a round trip.
    restored = await store.update_run(
        run.run_id, [Eq("status", RunStatus.RUNNING)], Update(set={"lease.token": token})
    )
    assert isinstance(restored, RunDocument)
    with pytest.raises(LeaseLost):
        await writer.write_checkpoint(Checkpoint(restart_node="after", progress=2))
    with pytest.raises(LeaseLost):
        await writer.write_status(RunStatus.FINISHED)
    with pytest.raises(LeaseLost):
        await writer.write_status(RunStatus.FAILED, failure_code="X", error="x")
    with pytest.raises(LeaseLost):
        await writer.write_cancelled()
    with pytest.raises(LeaseLost):
        await writer.write_record({"metrics": {"bytes": 1}})
    assert await writer.release() is None

    after = await store.get_run(run.run_id)
    assert after.version == restored.version
    assert after.checkpoint == checkpoint
    assert after.status is RunStatus.RUNNING
    assert after.lease is not None
    assert after.lease.token == token
    assert after.metrics == {}


async def test_fenced_writer_treats_a_moved_attempt_as_a_lost_lease(
    store: RunStore, load: Load, claim: Claim
) -> None:
    run, token = await claim(load("gate"))
    cancel = CancelSignal()
    writer = FencedWriter(store, run.run_id, token, run.attempt, cancel)
    moved = await store.update_run(
        run.run_id, [Eq("lease.token", token)], Update(set={"attempt": run.attempt + 1})
    )
    assert isinstance(moved, RunDocument)

    with pytest.raises(LeaseLost):
        await writer.write_status(RunStatus.FINISHED)

    assert cancel.reason is CancelReason.LEASE_LOST
    after = await store.get_run(run.run_id)
    assert after.version == moved.version
    assert after.status is RunStatus.RUNNING


async def test_a_pending_cancel_beats_every_status_write_but_finished(
    store: RunStore, load: Load, claim: Claim
) -> None:
    failing, failing_token = await claim(load("gate"))
    finishing, finishing_token = await claim(load("gate"))
    for run in (failing, finishing):
        asked = await store.update_run(
            run.run_id, [Eq("status", RunStatus.RUNNING)], Update(set={"cancel_requested": True})
        )
        assert isinstance(asked, RunDocument)

    failed = await FencedWriter(
        store, failing.run_id, failing_token, 1, CancelSignal()
    ).write_status(RunStatus.FAILED_RESUMABLE, failure_code="TIMEOUT", error="slow")
    finished = await FencedWriter(
        store, finishing.run_id, finishing_token, 1, CancelSignal()
    ).write_status(RunStatus.FINISHED)

    assert failed.status is RunStatus.CANCELLED
    assert failed.failure_code is None
    assert failed.cancel_requested is False
    assert finished.status is RunStatus.FINISHED


class _OnceUnavailable:
    """The store, whose next write carrying a checkpoint raises (an outage; nothing lands)."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner
        self.armed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_run(self, run_id: str, conditions: Any, update: Update, **kw: Any) -> Any:
        if self.armed and "checkpoint" in update.set:
            self.armed = False
            raise StoreUnavailable("the store went away (test)")
        return await self.inner.update_run(run_id, conditions, update, **kw)


@pytest.mark.parametrize("rides", [True, False], ids=["fleet", "local"])
async def test_node_finished_never_lands_without_the_checkpoint_that_completes_its_node(
    store: RunStore, load: Load, claim: Claim, events: Events, rides: bool
) -> None:
    """SPEC §13.6. A boundary write that raises keeps its checkpoint and its `node_finished`
    held: an event emitted meanwhile (a teardown's) does not flush `node_finished` on its own,
    and the release's checkpoint write carries both."""
    run, token = await claim(load("gate"))
    flaky = _OnceUnavailable(store)
    cancel = CancelSignal()
    writer = FencedWriter(flaky, run.run_id, token, run.attempt, cancel)  # type: ignore[arg-type]
    log = EventLog(flaky, run.run_id, run.attempt, token, cancel, defer=rides)  # type: ignore[arg-type]
    writer.events = log
    log.defer("node_finished", node="hold")
    boundary = Checkpoint(completed=["hold"], restart_node="after", progress=1)
    with pytest.raises(StoreUnavailable):
        await writer.write_checkpoint(boundary)

    await log.emit("sandbox_stopped")
    said = [e.type for e in await events(run.run_id)]
    assert said[-1] == "sandbox_stopped" and "node_finished" not in said
    assert (await store.get_run(run.run_id)).checkpoint != boundary

    released = await writer.release()
    assert released is not None and released.lease is None
    assert released.checkpoint == boundary
    said = [e.type for e in await events(run.run_id)]
    assert said.count("node_finished") == 1 and said[-1] == "node_finished"


class _RefusingStore:
    """The store, but every write fails as an outage does."""

    def __init__(self, store: RunStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def update_run(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the store went away (test)")


async def test_a_keeper_reports_refresh_tries_that_failed_and_the_lease_it_lost(
    store: RunStore, load: Load, claim: Claim, fast_lease: EngineSettings
) -> None:
    """Only successful refreshes were counted (`runfleet_lease_refreshes_total{outcome}` had
    only `ok`; an autoscaling walkthrough): a try that fails is `failed`, a lease lost to
    failures or taken over is `lost`."""
    for refusing in (True, False):
        run, token = await claim(load("gate"), settings=fast_lease)
        assert run.lease is not None
        said: list[str] = []
        keeper = LeaseKeeper(
            cast(RunStore, _RefusingStore(store)) if refusing else store,
            run.run_id,
            token,
            run.lease.expires_at,
            fast_lease.lease_timing(),
            CancelSignal(),
            on_trouble=said.append,
        )
        if not refusing:
            await steal(store, run, token)
        task = asyncio.ensure_future(keeper.run())
        try:
            await asyncio.wait_for(task, DEADLINE_S)  # it ends once the lease is lost
        finally:
            keeper.stop()
            task.cancel()
        if refusing:
            assert said[-1] == "lost" and said.count("failed") >= 1, said
        else:
            assert said == ["lost"]
