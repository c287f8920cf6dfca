"""The HTTP API's routes on runs (SPEC v2.2 §10c), each a thin call into `runner.operations`:
launch, status, list, events (a page, the merged timeline, a following SSE stream), resume,
cancel, rewind. Uploads are in `uploads_api.py`, the DLQ in `dlq_api.py`, the event stream in
`sse.py`; `ROUTES` is all of them.

A handler parses, calls one operation and shapes the answer; no rule of resume, cancel or
rewind lives here (STYLE.md: the console never re-implements an operation). What is decided
here is *who* may see a run: the operations look a full run id up in any tenant, so every
route that names a run first reads it through `routing.owned_run`, and another tenant's run is
`run_not_found` — the same answer as a run that does not exist, so a token learns nothing of
other tenants.
"""

from __future__ import annotations

import re
import uuid

from engine.failures import FailureCode
from engine.loader import LoadedWorkflow, load_workflow
from engine.resume import ResumeRequest
from runner import operations as ops
from runner.console.dlq_api import DLQ_ROUTES
from runner.console.models import (
    MAX_SEQ,
    EventOut,
    EventPage,
    LaunchRequest,
    ResumeRequestBody,
    RewindRequest,
    RewindResponse,
    RunOut,
    RunPage,
    Timeline,
    TimelineItem,
    UnreadableOut,
)
from runner.console.routing import Call, Param, Reply, Route, invalid, owned_run
from runner.console.sse import stream
from runner.console.uploads_api import UPLOAD_ROUTES, file_answers
from runner.operations.errors import IdempotencyKeyReused
from runner.operations.retry_wait import waiting_retry
from store import Event, RunAlreadyExists, RunDocument, RunNotFound, RunStatus
from store.settings import DURATION_FORM
from store.timeutil import parse_duration

IDEMPOTENCY_NAMESPACE = uuid.UUID("5b0c6d1e-4f0a-4c57-9a55-7c2f0e9d6a31")
"""uuid5 namespace of run ids made from an `Idempotency-Key`."""
IDEMPOTENCY_KEY_MAX = 200
EVENTS_PAGE_MAX = 5_000
"""Below the operations' read of 10 000 events, so a full page always shows there is more."""

FAILURE_CODES = frozenset(c.value for c in FailureCode)


def idempotent_run_id(tenant: str, key: str) -> str:
    """The run id a launch with `key` creates: the same for every retry of it, so the store's
    create-only insert is the durable key → run record, and a retry finds the first run
    (`RunAlreadyExists`) instead of queueing a second. The tenant is part of the name: two
    tenants using the same key get two runs."""
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{tenant}\n{key}"))


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def traceparent(call: Call) -> str | None:
    """The request's W3C `traceparent`, to carry on the message it queues (SPEC §3), or None
    when it has none or one that does not parse (W3C Trace Context: a malformed one is
    ignored, never refused)."""
    value = call.request.headers.get("traceparent", "").strip().lower()
    found = _TRACEPARENT.match(value)
    if found is None or found[1] == "ff" or set(found[2]) == {"0"} or set(found[3]) == {"0"}:
        return None
    return value


async def launch(call: Call) -> Reply:
    body = call.parsed(LaunchRequest)
    key = call.request.headers.get("Idempotency-Key")
    loaded = load_workflow(body.workflow, body.filename)
    run_id: str | None = None
    if key is not None:
        if not 0 < len(key) <= IDEMPOTENCY_KEY_MAX:
            raise invalid(f"Idempotency-Key: 1 to {IDEMPOTENCY_KEY_MAX} characters")
        run_id = idempotent_run_id(call.principal.tenant, key)
        try:  # a retry: its uploads were promoted by the first launch, so look before checking
            return _retried(await owned_run(call, run_id), loaded, body)
        except RunNotFound:
            pass
    try:
        doc = await ops.launch(
            call.env,
            loaded,
            body.vars,
            run_id=run_id,
            attach_uploads=body.attachments,
            traceparent=traceparent(call),
        )
    except RunAlreadyExists:  # a concurrent retry created it first
        assert run_id is not None
        return _retried(await owned_run(call, run_id), loaded, body)
    return Reply(RunOut.of(doc), 201)


def _retried(first: RunDocument, loaded: LoadedWorkflow, body: LaunchRequest) -> Reply:
    """The run a key made, for a retry of the request that made it; `IdempotencyKeyReused` when
    the key comes back with another workflow, other vars or other attachment names. Upload ids
    are not compared: the first launch consumed them, and the run keeps only what they held."""
    differs = [
        what
        for what, same in (
            ("workflow", first.workflow.source_hash == loaded.source_hash),
            ("vars", first.inputs == body.vars),
            ("attachments", {f.name for f in first.attachments} == set(body.attachments)),
        )
        if not same
    ]
    if differs:
        raise IdempotencyKeyReused(
            f"this Idempotency-Key launched run {first.run_id} from a request with other"
            f" {' and '.join(differs)}"
        )
    return Reply(RunOut.of(first), 200)


async def status(call: Call) -> RunOut:
    doc = await owned_run(call, call.path("run_id"))
    parked = await ops.parked_record_id(call.env, doc)  # as `runfleet status` shows it
    return RunOut.of(doc, await waiting_retry(call.env, doc), parked)


async def list_runs(call: Call) -> RunPage:
    statuses = call.query_all("status")
    known = {s.value for s in RunStatus}
    for given in statuses:
        if given not in known:
            raise invalid(f"status: {given[:40]!r} is not one of {', '.join(sorted(known))}")
    codes = call.query_all("code")
    for given in codes:  # a mistyped code matched nothing and read as "no such runs"
        if given not in FAILURE_CODES:
            raise invalid(f"code: {given[:40]!r} is not a failure code", "give one of the enum")
    since = call.query_str("since")
    try:
        within = parse_duration(since) if since is not None else None
    except ValueError:
        shown = (since or "")[:40]
        raise invalid(
            f"since: {shown!r} is not accepted: expected {DURATION_FORM} (at most 100 years)"
        ) from None
    page = await ops.list_runs(
        call.env,
        statuses=[RunStatus(s) for s in statuses],
        failure_codes=codes,
        created_within=within,
        workflow=call.query_str("workflow"),
        after=call.query_str("after"),
        limit=call.query_int("limit", 50, 1, 10_000),
        newest_first=True,
    )
    return RunPage(
        runs=[RunOut.of(r) for r in page.runs],
        next_after=page.next_after,
        unreadable=[UnreadableOut(run_id=u.run_id, error=u.error) for u in page.unreadable],
    )


async def events(call: Call) -> EventPage:
    """One page of events by seq; shown in the order people read (`queued_before_claimed`)."""
    doc = await owned_run(call, call.path("run_id"))
    after = call.query_int("after", 0, 0, MAX_SEQ)
    limit = call.query_int("limit", 1000, 1, EVENTS_PAGE_MAX)
    batch: list[Event] = []
    async for read in ops.event_batches(call.env, doc.run_id, after=after):
        batch.extend(read)
        if len(batch) > limit:
            break  # enough to fill this page and know another follows (not the whole run)
    kept = {e.seq for e in sorted(batch, key=lambda e: e.seq)[:limit]}
    page = [EventOut.of(e) for e in batch if e.seq in kept]
    return EventPage(events=page, next_after=max(kept) if len(batch) > limit else None)


async def timeline(call: Call) -> Timeline:
    doc = await owned_run(call, call.path("run_id"))
    after = call.query_int("after", 0, 0, MAX_SEQ)
    entries = [
        TimelineItem.model_validate(entry.as_json())
        async for batch in ops.timeline_batches(call.env, doc.run_id, after=after)
        for entry in batch
    ]
    return Timeline(entries=entries)


async def resume(call: Call) -> RunOut:
    body = call.parsed(ResumeRequestBody)
    doc = await owned_run(call, call.path("run_id"))
    request = ResumeRequest(
        answers=await file_answers(call, doc, body.answers),
        force=body.force,
        accept_scratch_loss=body.accept_scratch_loss,
        budget=body.budget.to_budget() if body.budget is not None else None,
        new_source=load_workflow(body.workflow, "workflow.yaml") if body.workflow else None,
    )
    return RunOut.of(await ops.resume(call.env, doc.run_id, request, traceparent=traceparent(call)))


async def cancel(call: Call) -> RunOut:
    doc = await owned_run(call, call.path("run_id"))
    return RunOut.of(await ops.cancel(call.env, doc.run_id))


async def rewind(call: Call) -> RewindResponse:
    body = call.parsed(RewindRequest)
    doc = await owned_run(call, call.path("run_id"))
    source = load_workflow(body.workflow, "workflow.yaml") if body.workflow else None
    result = await ops.rewind(call.env, doc.run_id, body.node, new_source=source)
    return RewindResponse(run=RunOut.of(result.run), dropped_nodes=list(result.dropped))


RUN = Param("run_id", "path", {"type": "string"}, "the run id or a unique prefix (6+)", True)
AFTER_SEQ = Param(
    "after", "query", {"type": "integer", "minimum": 0, "maximum": MAX_SEQ}, "events after seq"
)
RUN_ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/api/v1/runs",
        "launch",
        "Launch a run",
        launch,
        RunOut,
        LaunchRequest,
        (
            Param(
                "Idempotency-Key",
                "header",
                {"type": "string", "minLength": 1, "maxLength": IDEMPOTENCY_KEY_MAX},
                "a retried launch with the same key returns the first run (200); the key with"
                " another workflow, vars or attachment names is 422 idempotency_key_reused",
            ),
        ),
        writes=True,
        status=201,
        also=(200, 404, 422),
    ),
    Route(
        "GET",
        "/api/v1/runs",
        "list_runs",
        "List runs, newest first",
        list_runs,
        RunPage,
        params=(
            Param(
                "status",
                "query",
                {
                    "type": "array",
                    "items": {"type": "string", "enum": [s.value for s in RunStatus]},
                },
                "repeatable",
            ),
            Param(
                "code",
                "query",
                {"type": "array", "items": {"type": "string", "enum": sorted(FAILURE_CODES)}},
                "failure code, repeatable",
            ),
            Param("since", "query", {"type": "string"}, f"created within: {DURATION_FORM}"),
            Param("workflow", "query", {"type": "string"}, "the workflow's name"),
            Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 10_000}),
            Param("after", "query", {"type": "string"}, "next_after of the page before"),
        ),
        also=(404,),  # an `after` no run of the caller's has: run_not_found
    ),
    Route(
        "GET",
        "/api/v1/runs/{run_id}",
        "get_run",
        "Show a run",
        status,
        RunOut,
        params=(RUN,),
        also=(404,),
    ),
    Route(
        "GET",
        "/api/v1/runs/{run_id}/events",
        "events",
        "A page of a run's events",
        events,
        EventPage,
        params=(
            RUN,
            AFTER_SEQ,
            Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": EVENTS_PAGE_MAX}),
        ),
        also=(404,),
    ),
    Route(
        "GET",
        "/api/v1/runs/{run_id}/events/stream",
        "follow_events",
        "Follow a run's events (server-sent events)",
        stream,
        None,
        params=(RUN, AFTER_SEQ, Param("Last-Event-ID", "header", {"type": "string"})),
        also=(404,),
    ),
    Route(
        "GET",
        "/api/v1/runs/{run_id}/timeline",
        "timeline",
        "A run's events merged with its delivery log",
        timeline,
        Timeline,
        params=(RUN, AFTER_SEQ),
        also=(404,),
    ),
    Route(
        "POST",
        "/api/v1/runs/{run_id}/resume",
        "resume",
        "Resume a run",
        resume,
        RunOut,
        ResumeRequestBody,
        (RUN,),
        writes=True,
        also=(404, 409, 422),
    ),
    Route(
        "POST",
        "/api/v1/runs/{run_id}/cancel",
        "cancel",
        "Cancel a run",
        cancel,
        RunOut,
        params=(RUN,),
        writes=True,
        also=(404, 409),
    ),
    Route(
        "POST",
        "/api/v1/runs/{run_id}/rewind",
        "rewind",
        "Rewind a run",
        rewind,
        RewindResponse,
        RewindRequest,
        (RUN,),
        writes=True,
        also=(404, 409),
    ),
)

ROUTES: tuple[Route, ...] = RUN_ROUTES + UPLOAD_ROUTES + DLQ_ROUTES
