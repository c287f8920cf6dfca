"""The HTTP API's routes on dead-letter records (SPEC §3, §4 Replay, v2.2 §10c): list, show,
replay, purge, each through `runner.operations.dlq`.

A record belongs to the tenant of the run it carries; a record no run can be found for (a body
that never named one, a run collected since) belongs to the fleet's own tenant
(`RUNFLEET_TENANT`), whose operator drains what nobody else can claim. Another tenant's record
is `record_not_found`, as a record that does not exist is.
"""

from __future__ import annotations

import base64
from datetime import timedelta

from publisher.dlq import DlqRecord
from publisher.errors import RecordNotFound
from publisher.replay import replay_refusal
from runner import operations as ops
from runner.console.errors import REFUSAL_STATUS, ApiError, http_remedy
from runner.console.models import (
    MAX_SEQ,
    DlqDetail,
    DlqList,
    DlqRecordOut,
    DlqSelection,
    ErrorDetail,
    PurgeResponse,
    ReplayOutcomeOut,
    ReplayResponse,
    RunOut,
)
from runner.console.routing import Call, Param, Route, invalid, parse_int
from runner.operations.dlq import DLQ_REASONS
from store import RunfleetError
from store.settings import DURATION_FORM
from store.timeutil import parse_duration

DLQ_PAGE = 500
"""Records in a page of `GET /api/v1/dlq` when the caller does not say."""
DLQ_PAGE_MAX = 5_000


async def owner_of(call: Call, record: DlqRecord) -> str:
    return await ops.record_owner(call.env, record, call.fleet_tenant)


async def callers_records(call: Call, records: list[DlqRecord]) -> list[DlqRecord]:
    """The records of the caller's tenant (a record whose run is gone is the fleet's)."""
    return await ops.records_of(call.env, records, call.principal.tenant, call.fleet_tenant)


def parse_older_than(raw: str | None) -> timedelta | None:
    """A DLQ filter's `older_than` (`30m`, `2h`, seconds), or a typed 400 naming the form."""
    try:
        return parse_duration(raw) if raw is not None else None
    except ValueError:
        shown = (raw or "")[:40]
        raise invalid(
            f"older_than: {shown!r} is not accepted: expected {DURATION_FORM} (at most 100 years)"
        ) from None


def parse_reason(raw: str | None) -> str | None:
    """A DLQ filter's `reason`: one the fleet writes, or a typed 400 naming those accepted (a
    mistyped reason would match nothing and read as "no such records")."""
    if raw is None or raw in DLQ_REASONS:
        return raw
    raise invalid(f"reason: {raw[:40]!r} is not accepted: expected one of {', '.join(DLQ_REASONS)}")


async def selected_ids(call: Call, selection: DlqSelection, *, purge: bool) -> list[int]:
    """The ids a replay or purge acts on: each named id must be the caller's (else
    `record_not_found`, and nothing is done), or with `all` the caller's records that match.
    The filters narrow `all` only; beside ids they would be dropped unsaid, so they are refused."""
    if (selection.ids is None) == (not selection.all):
        raise invalid("give either ids or all: true", "name the records, or ask for all")
    if not purge and selection.older_than is not None:
        raise invalid("older_than narrows a purge, not a replay")
    given = [f for f in ("reason", "older_than") if getattr(selection, f) is not None]
    if selection.ids is not None and given:
        raise invalid(
            f"{' and '.join(given)} narrow{'s' if len(given) == 1 else ''} all: true, not ids",
            f"drop {' and '.join(given)}, or ask for all instead of naming ids",
        )
    records = await ops.select_records(
        call.env,
        selection.ids,
        reason=selection.reason,
        older_than=parse_older_than(selection.older_than),
    )
    mine = await callers_records(call, records)
    if selection.ids is not None and len(mine) != len(records):
        theirs = sorted({r.id for r in records} - {r.id for r in mine})
        raise RecordNotFound(f"no DLQ record {theirs[0]}")
    return [r.id for r in mine]


async def list_records(call: Call) -> DlqList:
    """One page of the caller's records by id (a drill: a DLQ of thousands came back as one
    answer of megabytes). The DLQ stream is read whole either way; only the caller's records
    after `after` are looked up for their owner, and only until the page is full."""
    after = call.query_int("after", 0, 0, MAX_SEQ)
    limit = call.query_int("limit", DLQ_PAGE, 1, DLQ_PAGE_MAX)
    records = await ops.list_records(
        call.env,
        reason=parse_reason(call.query_str("reason")),
        older_than=parse_older_than(call.query_str("older_than")),
    )
    page: list[DlqRecord] = []
    for record in (r for r in records if r.id > after):
        if await owner_of(call, record) != call.principal.tenant:
            continue
        if len(page) == limit:
            return DlqList(records=[DlqRecordOut.of(r) for r in page], next_after=page[-1].id)
        page.append(record)
    return DlqList(records=[DlqRecordOut.of(r) for r in page], next_after=None)


async def show_record(call: Call) -> DlqDetail:
    record_id = parse_int(call.path("record_id"), "record_id", 1, MAX_SEQ)
    detail = await ops.show_record(call.env, record_id)
    if await owner_of(call, detail.record) != call.principal.tenant:
        raise RecordNotFound(f"no DLQ record {record_id}")
    run = (
        detail.run
        if detail.run is not None and detail.run.tenant == call.principal.tenant
        else None
    )
    return DlqDetail(
        record=DlqRecordOut.of(detail.record),
        body_b64=base64.b64encode(detail.body).decode(),
        message=detail.message.model_dump(mode="json") if detail.message is not None else None,
        undecodable=detail.undecodable,
        run=RunOut.of(run) if run is not None else None,
        replay_refusal=_error(replay_refusal(detail.record, run)),
    )


def _error(exc: RunfleetError | None) -> ErrorDetail | None:
    return None if exc is None else ErrorDetail.model_validate(exc.to_dict())


def _checked(selection: DlqSelection) -> DlqSelection:
    """The API's selection with its reason checked. Here rather than in `selected_ids`, which
    the console's forms share: they offer the reasons of the records a page lists."""
    parse_reason(selection.reason)
    return selection


async def replay(call: Call) -> ReplayResponse:
    """200 with one outcome per record when at least one was replayed (a refused record does
    not stop the others; each outcome says which). When none was, the answer is the first
    failure's own status — 409/404 for a refusal, 503 when NATS or the store went away — so a
    caller that reads only the status never takes "nothing happened" for success (found by an
    operator walkthrough: a single refused replay answered 200)."""
    ids = await selected_ids(call, _checked(call.parsed(DlqSelection)), purge=False)
    report = await ops.replay_records(call.env, ids)
    failed = [o for o in report.outcomes if o.error is not None]
    if failed and len(failed) == len(report.outcomes):
        if report.stopped_by is not None:
            raise report.stopped_by
        first = failed[0].error
        assert first is not None
        listed = "; ".join(
            f"{o.record_id}: [{o.error.code}] {o.error.message}" for o in failed if o.error
        )
        raise ApiError(
            REFUSAL_STATUS.get(first.code, 400),
            first.code,
            f"no record was replayed: {listed}",
            http_remedy(first.remedy),
        )
    return ReplayResponse(
        outcomes=[
            ReplayOutcomeOut(
                id=o.record_id,
                run=RunOut.of(o.run) if o.run is not None else None,
                error=_error(o.error),
            )
            for o in report.outcomes
        ],
        not_attempted=list(report.not_attempted),
        stopped_by=_error(report.stopped_by),
    )


async def purge(call: Call) -> PurgeResponse:
    ids = await selected_ids(call, _checked(call.parsed(DlqSelection)), purge=True)
    return PurgeResponse(purged=await ops.purge_records(call.env, ids))


RECORD = Param("record_id", "path", {"type": "integer", "minimum": 1, "maximum": MAX_SEQ}, "", True)
DLQ_ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/api/v1/dlq",
        "dlq_list",
        "List dead-letter records",
        list_records,
        DlqList,
        params=(
            Param("reason", "query", {"type": "string", "enum": list(DLQ_REASONS)}),
            Param("older_than", "query", {"type": "string"}, f"a duration: {DURATION_FORM}"),
            Param("after", "query", {"type": "integer", "minimum": 0, "maximum": MAX_SEQ}),
            Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": DLQ_PAGE_MAX}),
        ),
    ),
    Route(
        "GET",
        "/api/v1/dlq/{record_id}",
        "dlq_show",
        "Show a dead-letter record",
        show_record,
        DlqDetail,
        params=(RECORD,),
        also=(404,),
    ),
    Route(
        "POST",
        "/api/v1/dlq/replay",
        "dlq_replay",
        "Replay dead-letter records",
        replay,
        ReplayResponse,
        DlqSelection,
        writes=True,
        also=(404, 409),
    ),
    Route(
        "POST",
        "/api/v1/dlq/purge",
        "dlq_purge",
        "Purge dead-letter records",
        purge,
        PurgeResponse,
        DlqSelection,
        writes=True,
        also=(404,),
    ),
)
