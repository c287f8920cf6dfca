"""The console's DLQ pages (SPEC §4 Replay, v2.2 §10b): the records by reason and age, one
record with its body decoded, replay, and purge after a confirmation page — one record, the
ticked ones, or every record with a reason.

The selection, its ownership rule (a record is the tenant's whose run it carries; the fleet's
own tenant has those no run can be found for) and the operations are the API's
(`dlq_api.selected_ids`, `runner.operations.dlq`): the console adds pages, not rules.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from publisher.errors import RecordNotFound
from publisher.replay import replay_refusal
from runner import operations as ops
from runner.console import dlq_api
from runner.console.models import MAX_SEQ, DlqSelection
from runner.console.pages import (
    call_of,
    form_value,
    form_values,
    page,
    redirect,
    require_write,
    viewer,
)
from runner.console.routing import invalid, parse_int

BODY_SHOWN = 20_000
"""Characters of a record's body a page shows."""


async def dlq_page(request: web.Request) -> web.Response:
    call = call_of(request)
    # A reason the fleet never writes is the API's 400, not an empty page offering to
    # "replay every record with reason bogus" (an operator walkthrough).
    reason = dlq_api.parse_reason(request.query.get("reason") or None)
    older_than = request.query.get("older_than") or None
    records = await ops.list_records(
        call.env, reason=reason, older_than=dlq_api.parse_older_than(older_than)
    )
    mine = await dlq_api.callers_records(call, records)
    everything = mine if reason is None and older_than is None else None
    by_reason = Counter(r.reason for r in (everything or mine))
    return page(
        request,
        "dlq.html",
        records=sorted(mine, key=lambda r: r.at, reverse=True),
        by_reason=sorted(by_reason.items()),
        reason=reason or "",
        older_than=older_than or "",
    )


def _body_text(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= BODY_SHOWN else text[:BODY_SHOWN] + "\n…"


async def record_page(request: web.Request) -> web.Response:
    call = call_of(request)
    record_id = parse_int(request.match_info["record_id"], "record_id", 1, MAX_SEQ)
    detail = await ops.show_record(call.env, record_id)
    if await dlq_api.owner_of(call, detail.record) != call.principal.tenant:
        raise RecordNotFound(f"no DLQ record {record_id}")
    run = detail.run if detail.run and detail.run.tenant == call.principal.tenant else None
    decoded: Any = detail.message.model_dump(mode="json") if detail.message else None
    refusal = replay_refusal(detail.record, detail.run)  # as `dlq replay` would judge it
    return page(
        request,
        "dlq_record.html",
        refusal=refusal,
        record=detail.record,
        decoded=json.dumps(decoded, indent=2) if decoded is not None else None,
        undecodable=detail.undecodable,
        body=_body_text(detail.body),
        run=run,
        run_missing=detail.run_missing,
    )


def _selection(request: web.Request) -> DlqSelection:
    """The form's selection: ticked `id`s, or `all` with a `reason` (and `older_than`)."""
    try:
        ids = [int(raw) for raw in form_values(request, "id") if raw.strip()]
    except ValueError:
        raise invalid("a record id is not an integer") from None
    try:
        if ids:
            return DlqSelection(ids=ids)
        if form_value(request, "all") == "yes":
            return DlqSelection(
                all=True,
                reason=form_value(request, "reason") or None,
                older_than=form_value(request, "older_than") or None,
            )
    except ValidationError as exc:
        raise invalid(f"the selection does not read: {exc.errors()[0]['msg']}") from None
    raise invalid("no record selected", "tick the records, or choose all with a reason")


async def replay(request: web.Request) -> web.StreamResponse:
    require_write(request)
    call = call_of(request)
    selection = _selection(request)
    ids = await dlq_api.selected_ids(
        call, selection.model_copy(update={"older_than": None}), purge=False
    )
    report = await ops.replay_records(call.env, ids)
    parts = []
    for outcome in report.outcomes:
        if outcome.run is not None:
            parts.append(f"record {outcome.record_id} → run {outcome.run.run_id[:13]} queued")
        elif outcome.error is not None:
            parts.append(f"record {outcome.record_id} kept: {outcome.error.code}")
    if report.stopped_by is not None:
        parts.append(f"stopped: {report.stopped_by.message}")
    viewer(request).session.say("replay: " + ("; ".join(parts) or "no record matched"))
    return redirect("/ui/dlq")


async def purge(request: web.Request) -> web.StreamResponse:
    """Purge asks first: without `confirm=yes` it shows what would go, and a button that
    sends the same selection confirmed."""
    require_write(request)
    call = call_of(request)
    selection = _selection(request)
    ids = await dlq_api.selected_ids(call, selection, purge=True)
    if form_value(request, "confirm") != "yes":
        records = await ops.select_records(call.env, ids) if ids else []
        return page(request, "dlq_confirm.html", records=records, selection=selection)
    purged = await ops.purge_records(call.env, ids)
    listed = ", ".join(str(i) for i in purged) or "none"
    viewer(request).session.say(f"purged {len(purged)} record(s): {listed}")
    return redirect("/ui/dlq")


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/dlq", dlq_page)
    router.add_post("/dlq/replay", replay)
    router.add_post("/dlq/purge", purge)
    router.add_get("/dlq/{record_id}", record_page)
