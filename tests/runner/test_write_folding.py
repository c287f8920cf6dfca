"""Issue 19 levers 1 and 3 at the runner (ADR-0014), with a real nats-server and SQLite: what a
run writes, in which operation, and that the release rides with the outcome only when the
teardown has nothing to do (SPEC §5.4's order)."""

from __future__ import annotations

from typing import Any

from engine.cancel import CancelSignal
from engine.lease import LeaseKeeper
from engine.outcome import CancelReason
from store import CasConflict, RunDocument, StoreUnavailable, Update
from store.sqlite import SqliteRunStore
from tests.runner.conftest import Fleet
from tests.runner.test_held_lease import start_on

COMPUTE_ONLY = """\
name: two_sums
entry: a
nodes:
  a:
    kind: compute
    set:
      x: "1 + 1"
  b:
    kind: compute
    set:
      y: "outputs.a.x * 2"
edges:
  - {from: a, to: b}
"""


ONE_TOOL = """\
name: one_tool
entry: t
nodes:
  t:
    kind: tool
    run: echo hi
"""


class Recording:
    """The real store, recording each write a runner makes and the events that ride on it."""

    def __init__(self, inner: SqliteRunStore) -> None:
        self.inner = inner
        self.writes: list[tuple[Update, list[str]]] = []
        self.appends: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_run(self, run_id: str, conditions: Any, update: Update, **kw: Any) -> Any:
        result = await self.inner.update_run(run_id, conditions, update, **kw)
        if not isinstance(result, CasConflict):
            self.writes.append((update, [d.type for d in kw.get("events", ())]))
        return result

    async def append_event(self, run_id: str, type: str, *args: Any, **kwargs: Any) -> Any:
        self.appends.append(type)
        return await self.inner.append_event(run_id, type, *args, **kwargs)


async def _types(fleet: Fleet, run_id: str) -> list[str]:
    return [e.type for e in await fleet.store.read_events(run_id)]


async def test_events_ride_with_the_state_write_they_describe(fleet: Fleet) -> None:
    """A compute-only run: the claim, one write per node boundary carrying that node's
    narration (the first also `run_claimed`), the last boundary folded into the outcome with
    `run_finished` and the release. No event is appended on its own, and the log reads as it
    always did."""
    assert isinstance(fleet.store, SqliteRunStore)
    recording = Recording(fleet.store)
    await start_on(fleet, recording)
    run = await fleet.launch(COMPUTE_ONLY)
    done = await fleet.wait_status(run.run_id, "finished")
    assert done.lease is None and done.checkpoint is not None
    assert done.checkpoint.outputs == {"a": {"x": 2}, "b": {"y": 4}}
    assert recording.appends == []
    carried = [events for _, events in recording.writes]
    assert carried == [
        [],  # the claim: `run_claimed` waits for `stop_others` (SPEC §5.3)
        ["run_claimed", "node_started", "node_finished"],
        ["node_started", "node_finished", "run_finished"],
    ]
    last = recording.writes[-1][0]
    assert last.unset == ["lease"]  # the release rode with the status
    # ... and so did the last boundary's checkpoint: one write fewer per run.
    assert last.set["status"] == "finished"
    assert last.set["checkpoint"]["completed"] == ["a", "b"]
    assert last.set["checkpoint"]["restart_node"] is None
    assert await _types(fleet, run.run_id) == [
        "run_launched",
        "run_queued",
        "run_claimed",
        "node_started",
        "node_finished",
        "node_started",
        "node_finished",
        "run_finished",
    ]


async def test_the_release_rides_with_the_outcome_only_when_the_teardown_is_empty(
    fleet: Fleet,
) -> None:
    """A run that started a sandbox has a teardown to do: its status write keeps the lease, and
    a plain release follows the teardown (SPEC §5.4)."""
    assert isinstance(fleet.store, SqliteRunStore)
    recording = Recording(fleet.store)
    await start_on(fleet, recording)
    run = await fleet.launch(ONE_TOOL)
    done = await fleet.wait_status(run.run_id, "finished")
    assert done.lease is None
    status_writes = [u for u, _ in recording.writes if u.set.get("status") == "finished"]
    assert len(status_writes) == 1 and "lease" not in status_writes[0].unset
    # Nor does the last checkpoint ride: the teardown runs between it and the status write.
    assert "checkpoint" not in status_writes[0].set
    last_boundary = [u for u, _ in recording.writes if "checkpoint" in u.set][-1]
    assert last_boundary.set["checkpoint"]["completed"] == ["t"]
    last, events = recording.writes[-1]
    assert (dict(last.set), list(last.unset), events) == ({}, ["lease"], [])
    assert "sandbox_started" in await _types(fleet, run.run_id)


async def test_a_launch_answers_with_its_publication_before_the_record_lands(
    fleet: Fleet,
) -> None:
    """Lever 3: the launch awaits one write and one publish; its answer names the copy it
    published, and `flush()` waits for the record, which says the same."""
    run = await fleet.launch(COMPUTE_ONLY)
    assert run.publication is not None and run.publication.stream_seq is not None
    await fleet.publisher.flush()
    stored = await fleet.store.get_run(run.run_id)
    assert stored.publication == run.publication
    assert await _types(fleet, run.run_id) == ["run_launched", "run_queued"]


class _Refused:
    """A store whose lease refresh is refused: the lease reads as taken over."""

    def __init__(self, doc: RunDocument) -> None:
        self.doc = doc

    async def update_run(self, *args: Any, **kwargs: Any) -> CasConflict:
        return CasConflict(self.doc)


async def test_a_keeper_stopped_for_a_folded_release_does_not_call_the_lease_lost(
    fleet: Fleet,
) -> None:
    """The keeper's beat that meets the release it was stopped for is not a takeover: no
    `LEASE_LOST` on the execution's signal (else its disposition would be withheld)."""
    run = await fleet.launch(COMPUTE_ONLY)
    timing = fleet.engine.lease_timing()
    for stopped in (True, False):
        cancel = CancelSignal()
        keeper = LeaseKeeper(
            _Refused(run),  # type: ignore[arg-type]
            run.run_id,
            "tok",
            run.created_at + timing.ttl * 100,
            timing,
            cancel,
        )
        if stopped:
            keeper.stop()
        assert await keeper.refresh_once() is False
        assert (cancel.reason is CancelReason.LEASE_LOST) is not stopped


class _BoundaryRaises(Recording):
    """The real store, whose first write of node `a`'s boundary raises `StoreUnavailable` (a
    store outage at that instant; nothing lands)."""

    def __init__(self, inner: SqliteRunStore) -> None:
        super().__init__(inner)
        self.raised = False

    async def update_run(self, run_id: str, conditions: Any, update: Update, **kw: Any) -> Any:
        checkpoint = update.set.get("checkpoint")
        if not self.raised and checkpoint is not None and checkpoint["completed"] == ["a"]:
            self.raised = True
            raise StoreUnavailable("the store went away (test)")
        return await super().update_run(run_id, conditions, update, **kw)


async def test_a_completed_checkpointed_node_is_never_re_executed_when_its_boundary_write_raised(
    fleet: Fleet,
) -> None:
    """SPEC §13.6. Node `a`'s boundary write raises: `node_finished` must not land without the
    checkpoint that completes `a` — not in the outcome's status write that follows, nor on its
    own. Both ride together in that status write, so the resume starts at `b`. (Before the fix
    the status write carried `node_finished` alone and the resume ran `a` again: found by the
    chaos soak's store-fault window.)"""
    assert isinstance(fleet.store, SqliteRunStore)
    store = _BoundaryRaises(fleet.store)
    await start_on(fleet, store)
    run = await fleet.launch(COMPUTE_ONLY)
    done = await fleet.wait_status(run.run_id, "finished")
    assert store.raised and done.checkpoint is not None
    assert done.checkpoint.outputs == {"a": {"x": 2}, "b": {"y": 4}}
    failed = [u for u, _ in store.writes if u.set.get("status") == "failed_resumable"]
    assert len(failed) == 1 and failed[0].set["checkpoint"]["completed"] == ["a"]
    assert failed[0].set["checkpoint"]["restart_node"] == "b"
    events = await fleet.store.read_events(run.run_id)
    finished_by = {(e.execution, e.data["node"]) for e in events if e.type == "node_finished"}
    executions = [e.execution for e in events if e.type == "run_claimed"]
    assert len(executions) == 2
    for e in events:
        if e.type == "node_started":
            earlier = executions[: executions.index(e.execution)]
            assert not any((x, e.data["node"]) in finished_by for x in earlier), (
                f"node {e.data['node']} finished by an earlier execution and ran again"
            )
    assert [e.data["node"] for e in events if e.type == "node_started"] == ["a", "b"]
