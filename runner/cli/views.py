"""How runs and events look to people (tables, lines) and to programs (`--json`)."""

from __future__ import annotations

import json
from typing import Any

import click

from engine.failures import FailureCode, is_auto_resumable
from engine.refusals import LAPSED, next_step
from runner.operations.retry_wait import RetryWait
from store import Event, RunDocument, RunStatus, utcnow
from store.cas import lease_is_free
from store.timeutil import iso_z


def run_view(
    doc: RunDocument, retry: RetryWait | None = None, *, just_queued: bool = False
) -> dict[str, Any]:
    """The `--json` shape of a run (SPEC §10 fields first, then what an operator needs);
    `retry` is the automatic retry it waits for, when the caller looked it up (`status`)."""
    cp = doc.checkpoint
    prompt = human_prompt(doc)
    return {
        "run_id": doc.run_id,
        "status": str(doc.status),
        "failure_code": doc.failure_code,
        "error": doc.error,
        "attempt": doc.attempt,
        "workflow": {"name": doc.workflow.name, "source_hash": doc.workflow.source_hash},
        "created_at": iso_z(doc.created_at),
        "updated_at": iso_z(doc.updated_at),
        "tenant": doc.tenant,
        "origin": str(doc.origin),
        "cause_code": doc.cause_code,
        "restart_node": cp.restart_node if cp else None,
        "outputs": cp.outputs if cp else {},
        "pending_questions": prompt["questions"] if prompt else None,
        "prompt": prompt,
        "queued_resume": queued_resume(doc, just_queued=just_queued),
        "budget": doc.budget.model_dump(),
        "usage": cp.usage.model_dump() if cp else None,
        "lease": None
        if doc.lease is None
        else {"owner": doc.lease.owner, "expires_at": iso_z(doc.lease.expires_at)},
        "cancel_requested": doc.cancel_requested,
        "retry": retry.to_dict() if retry else None,
        "attachments": [a.model_dump() for a in doc.attachments],
    }


def human_prompt(doc: RunDocument) -> dict[str, Any] | None:
    """What the run asks a person, only while it waits for the answer: a cancelled or
    rewound run keeps the interaction in its checkpoint, but nothing is pending then."""
    cp = doc.checkpoint
    pending = cp.pending_interaction if cp else None
    if not pending or doc.status is not RunStatus.PAUSED_WAITING_HUMAN:
        return None
    return {
        "node": pending.get("node"),
        "message": pending.get("message", ""),
        "questions": pending.get("questions", []),
    }


def queued_resume(doc: RunDocument, *, just_queued: bool = False) -> dict[str, Any] | None:
    """The resume a queued run carries (its attempt's request), so `resume` can say what it
    queued rather than what the run was waiting for. `just_queued`: the caller queued this
    attempt itself, so it is said even when a runner already took the run (the document is read
    after the publish)."""
    spec = doc.resume_spec
    if spec is None or spec.attempt != doc.attempt:
        return None
    if doc.status is not RunStatus.QUEUED and not just_queued:
        return None
    return {
        "kind": spec.kind,
        "from_status": str(spec.prior_status),
        "answers": spec.answers,
        "budget": spec.budget.model_dump(exclude_none=True) if spec.budget else None,
    }


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


FAILING = frozenset({RunStatus.FAILED, RunStatus.FAILED_RESUMABLE, RunStatus.PAUSED_OPERATOR})
"""The statuses a failure code describes; on any other (a parked run cancelled, a failed run
resumed and queued) the code is the run's past, and is said so."""


def echo_run(
    doc: RunDocument,
    retry: RetryWait | None = None,
    *,
    just_queued: bool = False,
    dlq_record: int | None = None,
) -> None:
    """`dlq_record`: the record a `DLQ_PARKED` run waits on (`operations.parked_record_id`)."""
    v = run_view(doc, retry, just_queued=just_queued)
    click.echo(f"run       {v['run_id']}")
    click.echo(f"workflow  {v['workflow']['name']}  (attempt {v['attempt']}, {v['origin']})")
    said = ", cancel requested" if doc.cancel_requested and doc.status is RunStatus.RUNNING else ""
    click.echo(f"status    {v['status']}{said}" + (f", {retry.describe()}" if retry else ""))
    if v["failure_code"]:
        cause = f" (cause {doc.cause_code})" if doc.cause_code else ""
        if doc.status in FAILING:
            click.echo(f"failure   {v['failure_code']}{cause}: {v['error']}")
        else:
            click.echo(f"earlier   {v['failure_code']}{cause}: {v['error']} (now {doc.status})")
    if dlq_record is not None:
        click.echo(
            f"next      fix the cause, then `runfleet dlq replay {dlq_record}` (its DLQ record)"
            f" or `runfleet resume {doc.run_id}` (the record then stays, to purge)"
        )
    elif doc.status is RunStatus.FAILED_RESUMABLE and doc.failure_code == "DLQ_PARKED":
        click.echo(
            f"next      fix the cause, then `runfleet resume {doc.run_id}` (no DLQ record left)"
        )
    elif (step := next_line(doc)) is not None:
        click.echo(f"next      {step}")
    if v["restart_node"]:
        click.echo(f"at node   {v['restart_node']}")
    if doc.lease is not None and doc.status is RunStatus.RUNNING:
        # Who holds it, and until when: after a runner is SIGKILLed the run stays `running`
        # under that runner's lease until it lapses, which the status alone did not say.
        left = (doc.lease.expires_at - utcnow()).total_seconds()
        if left > 0:
            said = (
                f"expires in {left:.0f}s (its runner renews it while it lives; if that runner"
                " died, the run is taken over once it lapses)"
            )
        elif doc.origin == "local":
            # No queue carries a local run: nothing takes it over by itself (an audit).
            said = (
                f"lapsed {-left:.0f}s ago (not renewed: `runfleet resume {doc.run_id} --local`"
                " takes it over from its checkpoint)"
            )
        else:
            said = f"lapsed {-left:.0f}s ago (not renewed: the run is taken over by a redelivery)"
        click.echo(f"lease     {doc.lease.owner}, {said}")
    if v["prompt"]:
        if v["prompt"]["message"]:
            click.echo(f"asks      {v['prompt']['message']}")
        click.echo(f"waiting for answers (runfleet resume {doc.run_id} --answer NAME=VALUE ...):")
        for q in v["prompt"]["questions"]:
            req = "" if q.get("required", True) else " (optional)"
            click.echo(f"  {q['name']}: {q['type']}{req}  {q.get('description', '')}".rstrip())
    if v["queued_resume"]:
        click.echo(f"queued    {_describe_resume(v['queued_resume'])}")
    if v["usage"]:
        u = v["usage"]
        click.echo(
            f"usage     {u['iterations']} node runs, {u['elapsed']:.1f}s, ${u['cost_usd']:.4f}"
        )
    for node, out in v["outputs"].items():
        text = json.dumps(out, default=str)
        click.echo(f"  {node} = {text if len(text) <= 200 else text[:197] + '...'}")


def next_line(doc: RunDocument) -> str | None:
    """What a person can do next with a run that waits on one, by its status and code (a
    newcomer's walkthrough: only a parked run said it). None when nothing is theirs to do: the
    run is moving, finished, retried by itself, or asks its questions (the prompt lines)."""
    run_id, code = doc.run_id, doc.failure_code
    match doc.status:
        case RunStatus.PAUSED_OPERATOR if code == FailureCode.BUDGET_EXCEEDED:
            return (
                f"raise the cap it reached and resume: `runfleet resume {run_id}"
                " --max-iterations N` (or --max-duration, --max-cost-usd)"
            )
        case RunStatus.PAUSED_OPERATOR:
            return f"`runfleet resume {run_id}` continues it from its checkpoint"
        case RunStatus.FAILED_RESUMABLE if code == FailureCode.SCRATCH_NOT_PORTABLE:
            return (
                f"`runfleet resume {run_id} --accept-scratch-loss` continues it without its scratch"
            )
        case RunStatus.FAILED_RESUMABLE if code == FailureCode.AMBIGUOUS_EFFECT:
            return (
                "find out whether the node's effect happened (its events say what it did),"
                f" then `runfleet resume {run_id}` runs the node again"
            )
        case RunStatus.FAILED_RESUMABLE if not is_auto_resumable(code):
            return f"fix the cause, then `runfleet resume {run_id}`"
        case RunStatus.FAILED if doc.checkpoint is None:
            # Failed before it ran (LAUNCH_FAILED): nothing to rewind to (a review).
            return "it never ran: fix the cause, then launch it again (`runfleet launch FILE`)"
        case RunStatus.FAILED:
            return (
                "it is not retried: fix the workflow or its inputs, then"
                f" `runfleet rewind {run_id} --node NODE --file FIXED.yaml` and"
                f" `runfleet resume {run_id}`, or launch it again"
            )
        case RunStatus.CANCELLED:
            return f"`runfleet resume {run_id}` continues it from its checkpoint"
        case RunStatus.RUNNING if lease_is_free(doc, utcnow(), LAPSED) and doc.origin == "local":
            return (
                f"its process is gone: `runfleet resume {run_id} --local` takes it over from"
                " its checkpoint"
            )
        case RunStatus.RUNNING if lease_is_free(doc, utcnow(), LAPSED):
            return next_step("running, no runner holds it").replace("RUN", run_id)
    return None


def cancel_line(doc: RunDocument) -> str:
    """What `runfleet cancel` did: a running run only has the cancel requested (its runner
    checkpoints and stops on its own time), which its status alone, still `running`, hides."""
    if doc.status is RunStatus.CANCELLED:
        return "cancelled"
    return (
        "cancel requested: the runner checkpoints and stops;"
        f" `runfleet status {doc.run_id}` shows when it has"
    )


def _describe_resume(spec: dict[str, Any]) -> str:
    what = f"{spec['kind']} from {spec['from_status']}"
    if spec["answers"]:
        pairs = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in spec["answers"].items())
        what += f" with answers {pairs}"
    if spec["budget"]:
        what += " with budget " + ", ".join(f"{k}={v}" for k, v in spec["budget"].items())
    return what + "; a runner picks it up"


def event_line(event: Event) -> str:
    data = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in event.data.items())
    if event.type == "node_output":
        return f"  {event.data.get('node')}| {str(event.data.get('text', '')).rstrip()}"
    if event.type == "human_input_requested":
        data = _prompt_line(event.data)
    return f"{event.at.strftime('%H:%M:%S')} #{event.seq:<4} {event.type:<24} {data}"


def _prompt_line(data: dict[str, Any]) -> str:
    """`node=review asks "Approve?" questions: approved (bool), note (string, optional)`."""
    names = []
    for q in data.get("questions") or []:
        opt = "" if q.get("required", True) else ", optional"
        desc = f": {q['description']}" if q.get("description") else ""
        names.append(f"{q.get('name')} ({q.get('type')}{opt}){desc}")
    asks = f" asks {json.dumps(data['message'])}" if data.get("message") else ""
    return f"node={data.get('node')}{asks} questions: {'; '.join(names)}"
