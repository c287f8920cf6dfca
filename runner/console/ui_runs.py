"""The console's run pages (SPEC v2.2 §10b): the runs list with live counts, one run with its
merged timeline updating live, and its actions — answer the pending questions, resume, cancel,
rewind — each through `runner.operations`, as `runfleet resume|cancel|rewind` does.

The answer form is typed from the pending questions' schema, and its values go in exactly as
`--answer NAME=VALUE` strings do (`ResumeRequest.cli_answers`): the engine's coercion is the one
judge, so a wrongly typed answer is refused with the CLI's own `answers_invalid` message, shown
beside its field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from engine.errors import AnswersInvalid, AnswersRequired
from engine.resume import ResumeRequest
from engine.rewind import REWINDABLE
from runner import operations as ops
from runner.console.errors import ApiError
from runner.console.models import BudgetRequest, RunOut
from runner.console.pages import (
    call_of,
    form_value,
    fragment,
    live,
    page,
    redirect,
    require_write,
    viewer,
)
from runner.console.remedies import what_to_do
from runner.console.routing import invalid, owned_run
from runner.console.uploads_api import file_answers, file_questions
from runner.delivery_log import DeliveryEntry, read_deliveries
from runner.operations.retry_wait import waiting_retry
from runner.operations.runs import TimelineEntry, merge_timeline
from store import Event, RunDocument, RunfleetError, RunStatus
from store.settings import DURATION_FORM
from store.staging import StagedUploadNotFound
from store.timeutil import parse_duration

RUNS_SHOWN = 100
TIMELINE_SHOWN = 500
"""The newest entries of a run's timeline a page shows (`runfleet events` has them all)."""
EVENTS_READ = 10_000
RESUMABLE = frozenset(
    {
        RunStatus.PAUSED_WAITING_HUMAN,
        RunStatus.PAUSED_OPERATOR,
        RunStatus.FAILED_RESUMABLE,
        RunStatus.CANCELLED,
    }
)
CANCELLABLE = frozenset(
    {
        RunStatus.QUEUED,
        RunStatus.RUNNING,
        RunStatus.PAUSED_WAITING_HUMAN,
        RunStatus.PAUSED_OPERATOR,
        RunStatus.FAILED_RESUMABLE,
    }
)


# -- the runs list ------------------------------------------------------------------------------


def _filters(request: web.Request) -> dict[str, Any]:
    query = request.query
    known = {s.value for s in RunStatus}
    statuses = [s for s in query.getall("status", []) if s]
    for given in statuses:
        if given not in known:
            raise invalid(f"status: {given[:40]!r} is not one of {', '.join(sorted(known))}")
    since = query.get("since") or None
    try:
        within = parse_duration(since) if since else None
    except ValueError:
        shown = (since or "")[:40]
        raise invalid(
            f"since: {shown!r} is not accepted: expected {DURATION_FORM} (at most 100 years)"
        ) from None
    return {
        "statuses": [RunStatus(s) for s in statuses],
        "failure_codes": [c for c in query.getall("code", []) if c],
        "workflow": query.get("workflow") or None,
        "created_within": within,
        "since": since or "",
    }


async def _runs_fragments(request: web.Request) -> dict[str, str]:
    call = call_of(request)
    filters = _filters(request)
    listed = await ops.list_runs(
        call.env,
        statuses=filters["statuses"],
        failure_codes=filters["failure_codes"],
        workflow=filters["workflow"],
        created_within=filters["created_within"],
        limit=RUNS_SHOWN,
        newest_first=True,
    )
    counts = await call.env.store.status_counts(call.principal.tenant)
    return {
        "counts": fragment("_counts.html", counts={str(k): v for k, v in counts.items()}),
        "runs": fragment(
            "_runs_rows.html",
            runs=listed.runs,
            unreadable=listed.unreadable,
            more=listed.next_after,  # the page is full: say so, never stop without a word
            shown=RUNS_SHOWN,
        ),
    }


async def runs_page(request: web.Request) -> web.Response:
    query = request.query
    shown = {  # the filters as typed, kept in the form whether or not they are accepted
        "status": query.get("status", ""),
        "code": query.get("code", ""),
        "workflow": query.get("workflow", ""),
        "since": query.get("since", ""),
    }
    try:
        _filters(request)
    except ApiError as exc:
        # The page with the refusal under the form and the values as typed, not an error page
        # in its place (found by walkthroughs: a mistyped `since` lost every filter).
        call = call_of(request)
        counts = await call.env.store.status_counts(call.principal.tenant)
        fragments = {
            "counts": fragment("_counts.html", counts={str(k): v for k, v in counts.items()}),
            "runs": "",
        }
        return page(
            request,
            "runs.html",
            status=exc.status,
            fragments=fragments,
            shown=shown,
            filter_problem=exc.message,
            statuses=[s.value for s in RunStatus],
            query=None,
        )
    return page(
        request,
        "runs.html",
        fragments=await _runs_fragments(request),
        shown=shown,
        filter_problem=None,
        statuses=[s.value for s in RunStatus],
        query=request.query_string,
    )


async def runs_live(request: web.Request) -> web.StreamResponse:
    _filters(request)  # a bad filter is refused before the stream begins
    return await live(request, lambda: _runs_fragments(request))


# -- one run ------------------------------------------------------------------------------------


def _outputs(doc: RunDocument) -> dict[str, Any]:
    return doc.checkpoint.outputs if doc.checkpoint else {}


async def _context(request: web.Request, doc: RunDocument) -> dict[str, Any]:
    call = call_of(request)
    retry = await waiting_retry(call.env, doc)
    out = RunOut.of(doc, retry)
    # The nodes a rewind accepts (engine/rewind.py's "reached"): the completed ones and the
    # node a resume restarts at — a failed node is where "fix, rewind, resume" starts, and was
    # not offered (an operator walkthrough).
    cp = doc.checkpoint
    completed = list(cp.completed) if cp else []
    if cp is not None and cp.restart_node and cp.restart_node not in completed:
        completed.append(cp.restart_node)
    return {
        "run": doc,
        "out": out,
        "retry": retry.describe() if retry else None,
        "advice": what_to_do(doc.failure_code),
        "usage": doc.checkpoint.usage if doc.checkpoint else None,
        "resumable": doc.status in RESUMABLE,
        "cancellable": doc.status in CANCELLABLE,
        "completed": completed,
        "rewindable": doc.status in REWINDABLE,
    }


def _timeline_html(entries: Sequence[TimelineEntry], note: str | None = None) -> str:
    shown = list(entries)[-TIMELINE_SHOWN:]
    hidden = max(len(entries) - TIMELINE_SHOWN, 0)
    return fragment("_timeline.html", entries=shown, hidden=hidden, note=note)


def _run_fragments(
    request: web.Request,
    context: dict[str, Any],
    entries: Sequence[TimelineEntry],
    note: str | None = None,
) -> dict[str, str]:
    who = viewer(request)
    return {
        "summary": fragment("_summary.html", viewer=who, **context),
        "outputs": fragment("_outputs.html", outputs=_outputs(context["run"])),
        "timeline": _timeline_html(entries, note),
    }


async def _timeline(request: web.Request, run_id: str) -> tuple[list[TimelineEntry], str | None]:
    """The merged timeline; with NATS unreachable, the run's events alone and a note saying
    so. The run, its questions and its actions live in the store: an outage of the broker
    must not hide them (an operator walkthrough met a 503 page after 10 s while the API
    answered the same run at once)."""
    env = call_of(request).env
    entries: list[TimelineEntry] = []
    try:
        async for batch in ops.timeline_batches(env, run_id):
            entries.extend(batch)
    except RunfleetError as exc:
        if not ops.is_unreachable(exc):
            raise
        events = [e async for batch in ops.event_batches(env, run_id) for e in batch]
        note = f"delivery log not shown ({exc.code}: {exc.message}); the run's events follow"
        return merge_timeline(events, []), note
    return entries, None


async def run_page(
    request: web.Request,
    *,
    errors: dict[str, str] | None = None,
    values: dict[str, str] | None = None,
    problem: dict[str, object] | None = None,
    status: int = 200,
) -> web.Response:
    doc = await owned_run(call_of(request), request.match_info["run_id"])
    context = await _context(request, doc)
    fragments = _run_fragments(request, context, *await _timeline(request, doc.run_id))
    actions = fragment(
        "_actions.html",
        viewer=viewer(request),
        errors=errors or {},
        values=values or {},
        problem=problem,
        **context,
    )
    return page(
        request,
        "run.html",
        status=status,
        fragments=fragments,
        actions=actions,
        **context,
    )


async def run_view(request: web.Request) -> web.Response:
    return await run_page(request)


async def run_live(request: web.Request) -> web.StreamResponse:
    """The run's summary, outputs and timeline as they change; its actions too, once its
    status or attempt is no longer the one they were drawn with (typing in a form is never
    wiped). The attempt counts: a run answered elsewhere that asks its next question is
    `paused_waiting_human` again, and kept the old question's form (an operator walkthrough)."""
    call = call_of(request)
    doc = await owned_run(call, request.match_info["run_id"])
    drawn = {"with": request.query.get("status", "")}  # `status:attempt`
    events: list[Event] = []
    logged: list[DeliveryEntry] = []
    cursor = {"event": 0, "log": 0}
    async with call.env.publisher() as publisher:

        async def render() -> dict[str, str]:
            now = await call.env.store.get_run(doc.run_id)
            new = await call.env.store.read_events(
                doc.run_id, after_seq=cursor["event"], limit=EVENTS_READ
            )
            if new:
                cursor["event"] = new[-1].seq
                events.extend(new)
            more = await read_deliveries(
                publisher.js, publisher.names, doc.run_id, after=cursor["log"]
            )
            if more:
                cursor["log"] = more[-1][0]
                logged.extend(entry for _, entry in more)
            context = await _context(request, now)
            out = _run_fragments(request, context, merge_timeline(events, logged))
            state = f"{now.status.value}:{now.attempt}"
            if state != drawn["with"]:
                drawn["with"] = state  # sent once per change, then left to the person typing
                out["actions"] = fragment(
                    "_actions.html",
                    viewer=viewer(request),
                    errors={},
                    values={},
                    problem=None,
                    **context,
                )
            return out

        return await live(request, render)


# -- actions ------------------------------------------------------------------------------------


def _run_url(run_id: str) -> str:
    return f"/ui/runs/{run_id}"


def _queued_line(what: str, done: RunDocument) -> str:
    """`answered: attempt 2 queued`, or what became of it already: "queued (finished)" read as
    a contradiction, and a budget preflight that parks the run again is no queueing at all."""
    if done.status is RunStatus.QUEUED:
        return f"{what}: attempt {done.attempt} queued"
    if done.status is RunStatus.PAUSED_OPERATOR:
        return f"{what}, and parked again: {done.error or done.failure_code or 'paused_operator'}"
    return f"{what}: attempt {done.attempt} queued, and already {done.status.value}"


def _flash(request: web.Request, message: str) -> None:
    viewer(request).session.say(message)


async def answer(request: web.Request) -> web.StreamResponse:
    """Resume a `paused_waiting_human` run with the form's answers, as `--answer k=v`."""
    require_write(request)
    call = call_of(request)
    doc = await owned_run(call, request.match_info["run_id"])
    prompt = RunOut.of(doc).prompt
    if prompt is None:
        # The run stopped waiting after this form was drawn (cancelled or answered in another
        # tab): its answers are refused, as `resume --answer` refuses them. With no question
        # to read names from, they used to become a plain resume, which undid the cancel and
        # dropped the answers (found by an operator walkthrough).
        _flash(
            request,
            f"not answered: answers_invalid: run {doc.run_id} is {doc.status.value}, not waiting"
            " for answers; nothing was changed",
        )
        return redirect(_run_url(doc.run_id))
    names = [str(q.get("name")) for q in prompt.questions]
    values = {name: form_value(request, f"answer.{name}") for name in names}
    given = {name: value for name, value in values.items() if value.strip() != ""}
    files = set(file_questions(doc))
    try:
        # A file question is answered with a staged upload's id, as over the API: never a
        # path, which the operations would read from this server's disk (found by review:
        # `answer.doc=@/path` pulled a server file into the caller's run).
        uploaded: dict[str, Any] = {}
        for name in sorted(files & set(given)):
            try:
                uploaded |= await file_answers(call, doc, {name: {"upload": given[name].strip()}})
            except StagedUploadNotFound as exc:
                # Beside its field, the form kept (docs/console.md): an unknown id used to
                # replace the page with a 404 and lose every answer typed.
                errors = {
                    name: f"{exc.code}: {exc.message} — stage the file first"
                    " (`runfleet upload FILE` prints its id)"
                }
                return await run_page(request, errors=errors, values=values, status=422)
        typed = {name: value for name, value in given.items() if name not in files}
        request_ = ResumeRequest(answers=uploaded, cli_answers=typed)
        done = await ops.resume(call.env, doc.run_id, request_)
    except AnswersInvalid as exc:
        errors = {name: f"{exc.code}: {what} — {exc.remedy}" for name, what in exc.problems}
        return await run_page(request, errors=errors, values=values, status=422)
    except AnswersRequired as exc:
        text = f"{exc.code}: {exc.message} — {exc.remedy}"
        errors = {name: text for name in exc.missing}
        return await run_page(request, errors=errors, values=values, status=422)
    _flash(request, _queued_line("answered", done))
    return redirect(_run_url(doc.run_id))


_CAPS: dict[str, tuple[str, str, Callable[[str], float]]] = {
    # form field: (its label on the page, what it accepts, how it reads)
    "max_duration": (
        "max duration",
        f"{DURATION_FORM}, above zero",
        lambda raw: parse_duration(raw).total_seconds(),
    ),
    "max_cost_usd": ("max cost (USD)", "a number from 0 to 10^12", float),
    "max_iterations": ("max iterations", "a whole number from 1 to 10^9", int),
}
_CAP_FIELDS = {"max_duration": "max_duration_s", "max_cost_usd": "max_cost_usd"}


def _budget(request: web.Request) -> BudgetRequest:
    """The raised caps the resume form gives. A value that does not read, or is out of range,
    is refused naming the field as the page labels it, what was typed and what is accepted,
    as the CLI names its flags (SPEC §10 v2.2): never a parser's or validator's own words."""
    read: dict[str, Any] = {}
    for name, (label, accepted, parse) in _CAPS.items():
        raw = form_value(request, name).strip()
        if not raw:
            continue
        why = ""
        try:
            value = parse(raw)
        except (ValueError, OverflowError) as exc:
            # The duration parser's own words are a person's ("longer than 100 years");
            # float's and int's ("could not convert string to float") are not.
            why = f" ({exc})" if name == "max_duration" else ""
            value = None
        try:
            if value is None:
                raise ValueError(raw)
            BudgetRequest(**{_CAP_FIELDS.get(name, name): value})
        except ValueError:  # pydantic's ValidationError is a ValueError
            raise invalid(
                f"{label}: {raw[:40]!r} is not accepted{why}: expected {accepted}",
                f"correct {label} and resume again, or leave it empty to keep the run's cap",
            ) from None
        read[_CAP_FIELDS.get(name, name)] = value
    return BudgetRequest(**read)


async def resume(request: web.Request) -> web.StreamResponse:
    require_write(request)
    call = call_of(request)
    doc = await owned_run(call, request.match_info["run_id"])
    req = ResumeRequest(
        force=form_value(request, "force") == "yes",
        accept_scratch_loss=form_value(request, "accept_scratch_loss") == "yes",
        budget=_budget(request).to_budget(),
    )
    done = await ops.resume(call.env, doc.run_id, req)
    _flash(request, _queued_line("resumed", done))
    return redirect(_run_url(doc.run_id))


async def cancel(request: web.Request) -> web.StreamResponse:
    require_write(request)
    call = call_of(request)
    doc = await owned_run(call, request.match_info["run_id"])
    done = await ops.cancel(call.env, doc.run_id)
    if done.status is RunStatus.CANCELLED:
        _flash(request, "cancelled")
    else:  # running: only requested, as `runfleet cancel` says (its status alone hides it)
        _flash(request, "cancel requested: the runner checkpoints and stops; this page shows when")
    return redirect(_run_url(doc.run_id))


async def rewind(request: web.Request) -> web.StreamResponse:
    require_write(request)
    call = call_of(request)
    doc = await owned_run(call, request.match_info["run_id"])
    node = form_value(request, "node")
    if not node:
        raise invalid("name the node to rewind to")
    result = await ops.rewind(call.env, doc.run_id, node)
    dropped = ", ".join(result.dropped) or "nothing"
    _flash(request, f"rewound to {node} (dropped {dropped}); resume when ready")
    return redirect(_run_url(doc.run_id))


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/runs", runs_page)
    router.add_get("/runs/live", runs_live)
    router.add_get("/runs/{run_id}", run_view)
    router.add_get("/runs/{run_id}/live", run_live)
    router.add_post("/runs/{run_id}/answer", answer)
    router.add_post("/runs/{run_id}/resume", resume)
    router.add_post("/runs/{run_id}/cancel", cancel)
    router.add_post("/runs/{run_id}/rewind", rewind)
