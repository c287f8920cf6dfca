"""Fencing (SPEC §2 write conditions, §5.4, §13.1): an execution whose store calls stall past
its lease TTL is overtaken — another runner adopts the run and finishes it — and when the stalled
writes finally reach the store none of them lands: run-document writes are refused, no event of
the stale execution follows the adopter's claim. A refresh that never answers counts as failed,
so the stale runner itself gives the lease up at `expires_at - margin`. It sends no disposition
for its old delivery (an ack or nak there would act on the adopter's message)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from nats.aio.msg import Msg

from engine.outcome import CancelReason
from engine.sandbox.local import LocalSandboxDriver
from runner.config import RunnerSettings
from runner.deliveries import Delivery
from runner.delivery import handle
from runner.metrics import RunnerMetrics
from runner.runner import Runner
from store import CasConflict, Condition, Event, RunDocument, RunStatus, RunStore, Update
from store.sqlite import SqliteRunStore
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import (
    ledger,
    released,
    wait_for_ledger,
    workflow,
)


class GatedStore:
    """Fault injection around a real `SqliteRunStore` (not a mock): while the gate is shut,
    every `update_run` and `append_event` waits at it, as if the store stopped answering this
    runner. Everything else passes straight through. Calls that waited, or were made after the
    gate reopened, are recorded with their results."""

    def __init__(self, inner: SqliteRunStore) -> None:
        self.inner = inner
        self._open = asyncio.Event()
        self._open.set()
        self.reopened = False
        self.waiting = 0
        self.in_flight = 0
        self.late: list[tuple[str, object]] = []

    def shut(self) -> None:
        self._open.clear()

    def reopen(self) -> None:
        self.reopened = True
        self._open.set()

    async def _pass(self) -> bool:
        """Wait while the gate is shut; True when this call is late (it waited, or the gate
        had been reopened)."""
        if self._open.is_set():
            return self.reopened
        self.waiting += 1
        await self._open.wait()
        return True

    async def update_run(
        self, run_id: str, conditions: Sequence[Condition], update: Update, **kw: Any
    ) -> RunDocument | CasConflict:
        self.in_flight += 1
        try:
            late = await self._pass()
            result = await self.inner.update_run(run_id, conditions, update, **kw)
        finally:
            self.in_flight -= 1
        if late:
            self.late.append(("update_run", result))
        return result

    async def append_event(
        self,
        run_id: str,
        type: str,
        data: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
        execution: str | None = None,
    ) -> Event:
        self.in_flight += 1
        try:
            late = await self._pass()
            event = await self.inner.append_event(
                run_id, type, data, attempt=attempt, execution=execution
            )
        finally:
            self.in_flight -= 1
        if late:
            self.late.append(("append_event", event))
        return event

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def deliveries(metrics: RunnerMetrics) -> dict[tuple[str, str], float]:
    """The runner's `runfleet_deliveries_total` samples by (disposition, reason)."""
    return {
        (s.labels["disposition"], s.labels["reason"]): s.value
        for family in metrics.registry.collect()
        if family.name == "runfleet_deliveries"
        for s in family.samples
        if s.name.endswith("_total")
    }


def host_a_runner(fleet: Fleet, store: GatedStore) -> Runner:
    """Runner A on "another host" (its own data dir), over `store`, with its fetch loop off
    (the test hands it a delivery through the runner's own `handle`), and no sweeper or
    backstop: only the execution writes."""
    return Runner(
        store=cast(RunStore, store),
        driver=LocalSandboxDriver(fleet.tmp / "host-a"),
        data_dir=fleet.tmp / "host-a",
        blobs=fleet.blobs,
        settings=RunnerSettings(http_host="127.0.0.1", sweeper=False, backstop=False),
        engine=fleet.engine,
        wire=fleet.wire,
        owner="runner-a",
        consume=False,
    )


async def take_one_delivery(fleet: Fleet) -> Msg:
    """Fetch the next message from the fleet's consumer, as a runner's fetch would."""
    psub = await fleet.js.pull_subscribe_bind(fleet.names.consumer, stream=fleet.names.runs_stream)
    [msg] = await psub.fetch(1, timeout=5)
    await psub.unsubscribe()
    return msg


async def test_runner_with_store_writes_blocked_past_its_ttl_cannot_write_the_run_after_another_runner_adopted_it(  # noqa: E501
    fleet: Fleet, tmp_path: Path
) -> None:
    book, release = tmp_path / "ledger", tmp_path / "release"
    gated = GatedStore(await SqliteRunStore.open(fleet.tmp / "runs.db"))
    # Runner A lives on "another host" (its own data dir: B cannot stop A's sandbox, so A's node
    # runs on and ends by itself, as across pods). A is a real runner whose fetch loop is off:
    # the test hands it the run's first delivery through the runner's own `handle`, so A takes
    # exactly that one delivery and never competes for the redeliveries meant for B. No sweeper
    # or backstop: only the execution writes.
    a = host_a_runner(fleet, gated)
    a_delivery: asyncio.Task[None] | None = None
    try:
        await a.start()
        assert a.svc is not None
        # A and B share the embedded default (one SQLite file, one blob directory), which is
        # host-backed (SPEC v2.2 §7.2b); the gate hides the SQLite store behind a wrapper, so say
        # so, or A would bank and mark its scratch (adr/0011 amendment 1) and B's adoption would
        # be refused SCRATCH_NOT_PORTABLE: a scratch rule, not the fencing under test.
        a.svc.host_backed = True
        fleet.runners.append(a)
        run = await fleet.launch(
            workflow("three_steps"), {"ledger": str(book), "release": str(release)}
        )
        msg = await take_one_delivery(fleet)
        a_delivery = asyncio.ensure_future(
            handle(a.svc, Delivery.from_msg(msg, fleet.wire.max_deliver))
        )
        await wait_for_ledger(book, "two")
        claimed = await fleet.store.get_run(run.run_id)
        assert claimed.lease is not None and claimed.lease.owner == "runner-a"
        a_token = claimed.lease.token

        gated.shut()  # A's refreshes, checkpoints and events now hang
        b = await fleet.start_runner()  # its own SqliteRunStore on the same file

        async def adopted() -> Event | None:
            events = await fleet.store.read_events(run.run_id)
            return next(
                (e for e in events if e.type == "run_claimed" and e.data["path"] == "adoption"),
                None,
            )

        adoption = await eventually(adopted)
        assert adoption.data["runner"] == b.owner and adoption.execution != a_token
        assert gated.waiting >= 1  # A's store calls (its lease refresh first) hung
        release.touch()
        await fleet.wait_status(run.run_id, "finished")
        finished = await eventually(released(fleet, run.run_id))

        async def acked() -> bool:
            return await fleet.stream_messages() == 0

        await eventually(acked)
        events_before = await fleet.store.read_events(run.run_id)
        # By now A's lease is long past `expires_at - loss margin`: its refreshes never
        # answered, so A must count the lease lost (SPEC §5.4) even though its store hangs.
        held = a.svc.executions.get(run.run_id)
        knew = held is None or held.reason is CancelReason.LEASE_LOST

        gated.reopen()  # A's stalled writes reach the store now

        async def a_done() -> bool:
            return a_delivery is not None and a_delivery.done() and gated.in_flight == 0

        await eventually(a_done)
    finally:
        if a_delivery is not None and not a_delivery.done():
            a_delivery.cancel()
            await asyncio.wait([a_delivery])
        await a.shutdown()
        await gated.inner.close()

    after = await fleet.store.get_run(run.run_id)
    assert after.status is RunStatus.FINISHED
    assert after.version == finished.version
    assert after.updated_at == finished.updated_at
    assert after.checkpoint == finished.checkpoint
    assert after.lease is None and after.attempt == 1
    # Whatever run-document write A still sent once the store answered again (its hung
    # refresh, its checkpoint) was refused.
    writes = [result for kind, result in gated.late if kind == "update_run"]
    assert all(isinstance(r, CasConflict) for r in writes), gated.late
    # A sent no disposition for its delivery: only "none (lease lost)" is counted.
    assert deliveries(a.metrics) == {("none", "lease_lost"): 1.0}
    assert deliveries(b.metrics).get(("ack", "finished")) == 1.0
    info = await fleet.js.consumer_info(fleet.names.runs_stream, fleet.names.consumer)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert ledger(book) == {"one": 1, "two": 2, "three": 1}

    problems = []
    if not knew:
        problems.append(
            "runner A still held its execution as live after its lease lapsed and B finished"
            " the run: a refresh that never answers did not lose the lease at"
            " expires_at - margin (SPEC §5.4)"
        )
    events = await fleet.store.read_events(run.run_id)
    stale = [
        (e.seq, e.type, e.data) for e in events if e.execution == a_token and e.seq > adoption.seq
    ]
    if stale or events != events_before:
        problems.append(f"runner A appended events after B's claim (seq {adoption.seq}): {stale}")
    assert not problems, "\n".join(problems)
