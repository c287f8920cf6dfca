"""Operations on runs (SPEC §4, §6.7, §10): launch, run in-process, status, list, events,
resume (through the queue or in-process), cancel, rewind.

Each takes an open `Env` and what a person asked for, already parsed (a loaded workflow, a
`ResumeRequest`, a duration), and returns the typed answer or raises a typed error. The rules
live where they are decided — the publisher queues, the engine executes and rewinds, the store
keeps — and an operation only wires them to the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.loader import LoadedWorkflow
from engine.refusals import ScratchNotPortable
from engine.resume import ResumeRequest
from engine.vars import resolve_vars
from publisher.cancel import cancel_run
from publisher.errors import NatsUnavailable
from runner.operations import uploads
from runner.operations.env import Env
from runner.operations.ordering import queued_before_claimed, reading_times
from runner.operations.retry_wait import will_retry
from runner.operations.run_ids import resolve_run_id
from store import (
    Event,
    RunDocument,
    RunNotFound,
    RunPage,
    RunQuery,
    RunStatus,
    StagedFile,
    StoreError,
    utcnow,
)
from store.events import all_events

if TYPE_CHECKING:
    from engine import local as engine_local
    from engine import rewind as engine_rewind
    from runner.delivery_log import DeliveryEntry

# The engine's execution and the NATS client are imported by the operations that use them: a
# command that only reads the store starts without them (ADR-0024).

MOVING = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})
"""While a run is in one of these, `follow` keeps reading its events."""
FOLLOW_POLL_S = 0.5
EVENTS_PAGE = 10_000

OnEvent = Callable[[Event], None]


def still_moving(run: RunDocument) -> bool:
    """Whether `follow` keeps reading: queued or running, or waiting out the nak delay of an
    automatic retry (it will run again by itself); a settled or operator-waiting run is not."""
    return run.status in MOVING or will_retry(run)


async def launch(
    env: Env,
    loaded: LoadedWorkflow,
    inputs: dict[str, Any],
    *,
    tenant: str | None = None,
    run_id: str | None = None,
    attach_paths: Mapping[str, Path] | None = None,
    attach_uploads: Mapping[str, str] | None = None,
    traceparent: str | None = None,
) -> RunDocument:
    """Queue a new run of `loaded` for the fleet (SPEC §4 Launch). A given `run_id` is created
    only if no run has it (`RunAlreadyExists`): what makes a retried API launch idempotent.
    Attachments are promoted to the run id first (§8): a promotion that fails is
    `LaunchFailed`, with no run created and nothing queued."""
    from engine import local as engine_local

    tenant = tenant or env.tenant
    async with env.publisher() as publisher:
        files: list[StagedFile] = []
        if attach_paths or attach_uploads:
            resolve_vars(loaded.workflow, inputs)  # a bad var refuses before any byte moves
            run_id = run_id or engine_local.new_run_id()
            files = await uploads.promote(
                env, run_id, paths=attach_paths or {}, uploads=attach_uploads or {}, tenant=tenant
            )
        return await publisher.launch(
            loaded, inputs, tenant=tenant, run_id=run_id, attachments=files, traceparent=traceparent
        )


async def run_local(
    env: Env,
    loaded: LoadedWorkflow,
    inputs: dict[str, Any],
    *,
    tenant: str | None = None,
    on_event: OnEvent | None = None,
    interrupt: engine_local.LocalInterrupt | None = None,
    attach_paths: Mapping[str, Path] | None = None,
    attach_uploads: Mapping[str, str] | None = None,
) -> RunDocument:
    """Execute a new `local` run in this process to its outcome (no queue). `interrupt`: a
    person's stop, which ends the run `cancelled` with its checkpoint and lease released.
    Attachments are promoted to the run id first, as a launch's are (`LaunchFailed` when they
    cannot be: no run is created)."""
    from engine import local as engine_local

    tenant = tenant or env.tenant
    run_id: str | None = None
    files: list[StagedFile] = []
    if attach_paths or attach_uploads:
        resolve_vars(loaded.workflow, inputs)  # a bad var refuses before any byte moves
        run_id = engine_local.new_run_id()
        files = await uploads.promote(
            env, run_id, paths=attach_paths or {}, uploads=attach_uploads or {}, tenant=tenant
        )
    return await engine_local.run_local(
        _local(env, on_event, interrupt),
        loaded,
        inputs,
        tenant=tenant,
        run_id=run_id,
        attachments=files,
    )


def _local(
    env: Env, on_event: OnEvent | None, interrupt: engine_local.LocalInterrupt | None
) -> engine_local.LocalEnv:
    return dataclasses.replace(env.local(on_event), interrupt=interrupt)


async def get_run(env: Env, run_id: str) -> RunDocument:
    """The run `run_id` names (the id or a unique prefix of it, `run_ids`)."""
    return await env.store.get_run(await resolve_run_id(env, run_id))


STOPPED_ON_A_CODE = (RunStatus.FAILED_RESUMABLE, RunStatus.FAILED, RunStatus.PAUSED_OPERATOR)
"""The statuses whose `failure_code` says why the run stands where it is (a budget pause
included); in any other status the code is a past one."""


async def list_runs(
    env: Env,
    *,
    statuses: Sequence[RunStatus] = (),
    failure_codes: Sequence[str] = (),
    created_within: timedelta | None = None,
    workflow: str | None = None,
    after: str | None = None,
    limit: int = 50,
    tenant: str | None = None,
    newest_first: bool = False,
) -> RunPage:
    """One page of the tenant's runs, oldest first or `newest_first` (keyset paging on the
    time-ordered run id; `after` continues in the same direction).

    `failure_codes` without `statuses` means the runs stopped on one of those codes now: a
    run keeps its last code after a direct cancel or while its resume is queued (`status`
    shows it as "earlier"), and an operator asking for the `DLQ_PARKED` runs must not be
    handed the ones already cancelled. Given statuses are taken as they are."""
    tenant = tenant or env.tenant
    if failure_codes and not statuses:
        statuses = STOPPED_ON_A_CODE
    return await env.store.list_runs(
        RunQuery(
            statuses=list(statuses),
            failure_codes=list(failure_codes),
            created_since=utcnow() - created_within if created_within is not None else None,
            tenant=tenant,
            workflow=workflow,
            after_run_id=await _page_after(env, after, tenant) if after is not None else None,
            newest_first=newest_first,
            limit=limit,
        )
    )


async def _page_after(env: Env, after: str, tenant: str) -> str:
    """The run `after` names (an id or a unique prefix, as everywhere a run is named). The
    keyset compares ids as strings, so an id no run has would page from wherever it sorts —
    usually the start — and a typo would silently list the wrong page: `run_not_found`
    instead. Another tenant's run is not found either, as `owned_run` answers in the API."""
    return await resolve_run_id(env, after, tenant=tenant)


async def event_batches(
    env: Env, run_id: str, *, after: int = 0, follow: bool = False
) -> AsyncIterator[list[Event]]:
    """A run's events after `after`, in batches as they are read: every one of them, page by
    page (a scale drill: one page of 10 000 was all a 40 000-event run showed, with no word of
    the rest). With `follow`, keep reading while the run is queued, running or waiting for an
    automatic retry (`still_moving`), and stop once it settled or waits for an operator, and
    nothing new came."""
    run_id = await resolve_run_id(env, run_id)  # run_not_found before anything else
    while True:
        events = await env.store.read_events(run_id, after_seq=after, limit=EVENTS_PAGE)
        if events:
            after = events[-1].seq
            yield queued_before_claimed(events)
        if len(events) == EVENTS_PAGE:
            continue  # a full page: more may follow at once
        if not follow:
            return
        run = await env.store.get_run(run_id)
        if not still_moving(run) and not events:
            return
        await asyncio.sleep(FOLLOW_POLL_S)


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One line of a run's merged timeline (SPEC v2.2 §10b): an event of the run, or an entry
    of the delivery log about one of its deliveries."""

    at: datetime
    source: Literal["event", "delivery"]
    event: Event | None = None
    delivery: DeliveryEntry | None = None

    def as_json(self) -> dict[str, Any]:
        item = self.event if self.event is not None else self.delivery
        assert item is not None
        return {"source": self.source, **item.model_dump(mode="json")}


def merge_timeline(
    events: Sequence[Event], deliveries: Sequence[DeliveryEntry]
) -> list[TimelineEntry]:
    """Merge by time, keeping each source's own order (event seq, log sequence): two clocks
    that disagree by a millisecond never reorder a run's events among themselves. The events'
    order is the one people read (`ordering.queued_before_claimed`)."""
    ordered = queued_before_claimed(events)
    return [
        entry
        for _, entry in heapq.merge(
            (
                (t, TimelineEntry(e.at, "event", event=e))
                for t, e in zip(reading_times(ordered), ordered, strict=True)
            ),
            ((d.at, TimelineEntry(d.at, "delivery", delivery=d)) for d in deliveries),
            key=lambda pair: pair[0],
        )
    ]


async def timeline_batches(
    env: Env, run_id: str, *, after: int = 0, follow: bool = False
) -> AsyncIterator[list[TimelineEntry]]:
    """A run's events and its delivery-log entries, merged in order by time (SPEC v2.2 §10b),
    in batches as they are read; `after` and `follow` as in `event_batches` (`after` is an
    event seq: delivery-log entries from before that event's time are left out too, as the
    events are; found by a newcomer: `--after N --deliveries` showed every earlier delivery).
    Without `follow` the one batch is the whole timeline, in order; while following, each
    batch is ordered and comes after the ones before it."""
    from runner.delivery_log import read_deliveries  # NATS, once it is needed (ADR-0024)

    run_id = await resolve_run_id(env, run_id)  # run_not_found before anything else
    after_event, after_log = after, 0
    since = await _time_of_event(env, run_id, after) if after > 0 else None
    async with env.publisher() as publisher:
        while True:
            # every page of events there is now, to merge with the whole log
            pages = all_events(env.store, run_id, after=after_event, page=EVENTS_PAGE)
            events = [e async for e in pages]
            if events:
                after_event = events[-1].seq
            logged = await read_deliveries(publisher.js, publisher.names, run_id, after=after_log)
            if logged:
                after_log = logged[-1][0]
            # `>=`: the merge puts an entry stamped in event N's millisecond after event N.
            entries = [entry for _, entry in logged if since is None or entry.at >= since]
            if events or entries:
                yield merge_timeline(events, entries)
            if not follow:
                return
            run = await env.store.get_run(run_id)
            if not still_moving(run) and not events and not logged:
                return
            await asyncio.sleep(FOLLOW_POLL_S)


async def _time_of_event(env: Env, run_id: str, seq: int) -> datetime:
    """When event `seq` of the run was written; now when it has no such event yet (what
    happened so far is all before it)."""
    found = await env.store.read_events(run_id, after_seq=seq - 1, limit=1)
    return found[0].at if found and found[0].seq == seq else utcnow()


async def resume(
    env: Env,
    run_id: str,
    request: ResumeRequest,
    *,
    tenant: str | None = None,
    traceparent: str | None = None,
) -> RunDocument:
    """Resume through the queue (SPEC §4 Resume): refusals in order, one CAS, publish. A
    `file` answer given as a local path is staged first and sent as its upload id (§6.4)."""
    run_id = await resolve_run_id(env, run_id)
    tenant = tenant or env.tenant
    run = await env.store.get_run(run_id)
    request = await uploads.stage_file_answers(env, run, request, tenant=tenant)
    try:
        async with env.publisher() as publisher, _naming_a_refused_bank(env, run_id):
            return await publisher.resume(run_id, request, tenant=tenant, traceparent=traceparent)
    except NatsUnavailable as exc:
        if run.origin != "local":
            raise
        # A run `runfleet run` started, resumed without --local where no fleet runs: the
        # remedy named only the fleet (found by a newcomer's walkthrough).
        exc.remedy = (
            f"{exc.remedy}; or resume it in this process, as it was run:"
            f" `runfleet resume {run_id} --local`"
        )
        raise


async def resume_local(
    env: Env,
    run_id: str,
    request: ResumeRequest,
    *,
    auto_resume: int = 0,
    on_event: OnEvent | None = None,
    interrupt: engine_local.LocalInterrupt | None = None,
) -> RunDocument:
    """Resume in this process (SPEC §5.3 Local), re-claiming up to `auto_resume` times while
    the outcome is an auto-resumable failure; `interrupt` as in `run_local` (no re-claim once
    it was asked). A `file` answer naming a local file is staged first, as `resume` does, so
    the run holds it as an attachment wherever it executes next (SPEC §6.4, §8)."""
    from engine import local as engine_local

    run_id = await resolve_run_id(env, run_id)
    run = await env.store.get_run(run_id)
    request = await uploads.stage_file_answers(env, run, request, tenant=env.tenant)
    async with _naming_a_refused_bank(env, run_id):
        return await engine_local.resume_local(
            _local(env, on_event, interrupt), run_id, request, auto_resume=auto_resume
        )


@contextlib.asynccontextmanager
async def _naming_a_refused_bank(env: Env, run_id: str) -> AsyncIterator[None]:
    """A resume refused `scratch_not_portable` because the last teardown could not bank the
    scratch says why the bank was refused (a missing bucket, an endpoint down): the operator
    decides between fixing that and `--accept-scratch-loss` on it, and it was only in the
    run's events (a walkthrough)."""
    try:
        yield
    except ScratchNotPortable as exc:
        cause = await _bank_refusal(env, run_id)
        if cause is None:
            raise
        raise exc.naming(cause) from exc


async def _bank_refusal(env: Env, run_id: str) -> str | None:
    """The `reason` of the run's last `sandbox_scratch_banked` event when its scratch record
    says `unbankable`; None otherwise (or when the store cannot say)."""
    try:
        run = await env.store.get_run(run_id)
        if run.scratch is None or run.scratch.state != "unbankable":
            return None
        reason: str | None = None
        after = 0
        while batch := await env.store.read_events(run_id, after_seq=after, limit=1000):
            for event in batch:
                if event.type == "sandbox_scratch_banked" and event.data.get("reason"):
                    reason = str(event.data["reason"])
            after = batch[-1].seq
    except (StoreError, RunNotFound):  # the refusal as it was is still true
        return None
    return reason


async def cancel(env: Env, run_id: str, *, tenant: str | None = None) -> RunDocument:
    """Cancel (SPEC §4 Cancel); a running run is asked to checkpoint and stop."""
    run_id = await resolve_run_id(env, run_id)
    try:
        async with env.publisher() as publisher:
            return await publisher.cancel(run_id, tenant=tenant or env.tenant)
    except NatsUnavailable:
        # The signal is the only part that needs NATS, and it is best effort: the CAS alone
        # cancels what is not running, and a running execution reads it at its next refresh.
        skew = env.wire().lease_skew
        return await cancel_run(
            env.store, run_id, tenant=tenant or env.tenant, skew=skew, signal=None
        )


async def rewind(
    env: Env, run_id: str, node: str, *, new_source: LoadedWorkflow | None = None
) -> engine_rewind.RewindResult:
    """Move the checkpoint back to `node` and park the run `paused_operator` (SPEC §6.7)."""
    from engine import rewind as engine_rewind

    return await engine_rewind.rewind(
        env.store,
        await resolve_run_id(env, run_id),
        node,
        new_source=new_source,
        skew_s=env.engine.lease_skew.total_seconds(),
    )
