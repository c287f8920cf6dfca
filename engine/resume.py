"""Judging a resume and computing its effects (SPEC §4, §5.3, §5.7, §6.4, §7.4).

`judge_resume` raises the surface refusals in the order SPEC §4 gives and returns the attempt's
`ResumeSpec`; nothing is written. `claim_effects` is what the *fresh* (or local) claim of that
attempt writes in its own CAS: answers as the paused node's output, merged budget, a forced
source, a forsaken scratch. Consents themselves are never written anywhere but `resume_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.answers import coerce_answers
from engine.budget import below_consumed, merge_overrides
from engine.errors import AnswersInvalid, AnswersRequired
from engine.loader import LoadedWorkflow, load_stored_workflow
from engine.refusals import (
    LAPSED,
    BudgetBelowConsumed,
    RunNotResumable,
    ScratchNotPortable,
    SourceLacksRestartNode,
    WorkflowSourceChanged,
)
from engine.scratch import moved_past
from engine.workflow import HumanNode, Workflow
from store import (
    Budget,
    Checkpoint,
    Consents,
    ResumeSpec,
    RunDocument,
    RunStatus,
    WorkflowRef,
    lease_is_free,
    utcnow,
)
from store.status import OPERATOR_RESUMABLE


@dataclass(frozen=True)
class ResumeRequest:
    """A resume as asked. `answers` are typed JSON (`--answers-file`, the queue);
    `cli_answers` are `--answer k=v` strings, parsed to each question's type, and win."""

    answers: dict[str, Any] = field(default_factory=dict)
    cli_answers: dict[str, str] = field(default_factory=dict)
    answers_base_dir: Path | None = None
    force: bool = False
    accept_scratch_loss: bool = False
    budget: Budget | None = None
    new_source: LoadedWorkflow | None = None


def scratch_problem(run: RunDocument) -> str | None:
    """Why the run's scratch cannot follow it, or None (SPEC §7.4)."""
    rec = run.scratch
    if rec is None or rec.forsaken:
        return None
    if rec.state == "unbankable":
        return "the last teardown could not bank a non-empty scratch"
    cp = run.checkpoint or Checkpoint()
    if rec.state == "banked" and moved_past(cp, rec):
        return "the run moved past its bank (a sandbox node finished after it)"
    if rec.state == "unknown" and moved_past(cp, rec):
        return (
            f"the run moved past its bank: execution {rec.lease_token} finished a sandbox node"
            " and ended before its teardown banked the scratch"
        )
    return None


def judge_resume(run: RunDocument, request: ResumeRequest) -> ResumeSpec:
    if run.status not in OPERATOR_RESUMABLE:
        if run.status is RunStatus.RUNNING and lease_is_free(run, utcnow(), LAPSED):
            # Nothing holds it: say how it moves again (a disk-full drill found runs left so
            # for good, and "it is already running" named no way out).
            raise RunNotResumable(run.run_id, "running, no runner holds it")
        raise RunNotResumable(run.run_id, run.status)
    answers: dict[str, Any] = {}
    pending = (run.checkpoint.pending_interaction if run.checkpoint else None) or None
    if run.status is RunStatus.PAUSED_WAITING_HUMAN and pending is not None:
        workflow = load_stored_workflow(run.workflow.source, f"run {run.run_id}").workflow
        node = workflow.nodes.get(str(pending.get("node")))
        no_answers = not request.answers and not request.cli_answers
        if isinstance(node, HumanNode):
            required = [q.name for q in node.questions if q.required]
            if no_answers and not required:
                # SPEC §4: a paused run resumed with no answers at all is refused, even when
                # every question is optional: the resume is the person's reply, so an
                # all-optional node still needs one answer to say someone looked.
                raise AnswersRequired([q.name for q in node.questions], any_of=True)
            # Otherwise `coerce_answers` names the required questions left unanswered, never
            # the optional ones: listing those sent people to answer what they may skip.
            answers = _coerce_mixed(node, request)
        elif no_answers:
            raise AnswersRequired([])
    elif request.answers or request.cli_answers:
        # An answer to a run that asks nothing would be dropped without a word (a cancelled
        # run that was waiting asks again once resumed): SPEC §4's `answers_invalid`.
        name = next(iter({**request.answers, **request.cli_answers}))
        raise AnswersInvalid(
            name,
            f"run {run.run_id} is {run.status}, not waiting for answers",
            remedy="resume it without answers, and answer when it asks (`runfleet status RUN`"
            " shows its questions)",
        )
    scratch_why = scratch_problem(run)
    source_changed = (
        request.new_source is not None
        and request.new_source.source_hash != run.workflow.source_hash
    )
    if scratch_why is not None and not request.accept_scratch_loss:
        raise ScratchNotPortable(
            run.run_id, scratch_why, also_needs_force=source_changed and not request.force
        )
    if source_changed and not request.force:
        raise WorkflowSourceChanged(run.run_id)
    if source_changed and request.new_source is not None:
        _check_restart_node(run, request.new_source.workflow)
    if request.budget is not None:
        merged = merge_overrides(run.budget, request.budget)
        usage = (run.checkpoint or Checkpoint()).usage
        low = [f for f in below_consumed(merged, usage) if getattr(request.budget, f) is not None]
        if low:
            raise BudgetBelowConsumed(run.run_id, low)
    new_ref = None
    if source_changed and request.new_source is not None:
        new_ref = WorkflowRef(
            name=request.new_source.workflow.name,
            source=request.new_source.source,
            source_hash=request.new_source.source_hash,
        )
    return ResumeSpec(
        attempt=run.attempt + 1,
        prior_status=run.status,
        answers=answers,
        consents=Consents(force=request.force, accept_scratch_loss=request.accept_scratch_loss),
        budget=request.budget,
        workflow=new_ref,
        published_at=utcnow(),
    )


def _check_restart_node(run: RunDocument, workflow: Workflow) -> None:
    """A forced source swap keeps the checkpoint, so the new workflow must hold the node the
    run restarts at, and the question it waits on as a question (found by review: the swap was
    accepted and the claim then crashed on the missing node, an INTERNAL_ERROR retried until
    the DLQ)."""
    cp = run.checkpoint
    if cp is None:
        return
    pending = cp.pending_interaction
    if pending is not None:
        node = str(pending.get("node"))
        if not isinstance(workflow.nodes.get(node), HumanNode):
            raise SourceLacksRestartNode(run.run_id, node, "has no human node")
    if cp.restart_node is not None and cp.restart_node not in workflow.nodes:
        raise SourceLacksRestartNode(run.run_id, cp.restart_node, "has no node")


def _coerce_mixed(node: HumanNode, request: ResumeRequest) -> dict[str, Any]:
    """Parse the CLI strings first (every question optional for that pass), then check the
    merged answers strictly against the real schema."""
    merged = dict(request.answers)
    wrong: list[AnswersInvalid] = []
    failed: set[str] = set()
    optional = [q.model_copy(update={"required": False}) for q in node.questions]
    for name, text in (request.cli_answers or {}).items():
        # One at a time, so one that does not parse does not hide the others' problems: every
        # wrong answer is named at once, as for typed answers (a review).
        try:
            parsed = coerce_answers(
                optional, {name: text}, from_cli=True, base_dir=request.answers_base_dir
            )
        except AnswersInvalid as exc:
            wrong.append(exc)
            failed.add(name)
            continue
        merged[name] = parsed[name]
    # A question whose answer did not parse is named once, for that, not again as missing.
    questions = [
        q.model_copy(update={"required": False}) if q.name in failed else q for q in node.questions
    ]
    try:
        answers = coerce_answers(
            questions,
            merged,
            from_cli=False,
            base_dir=request.answers_base_dir,
            answered_elsewhere=bool(wrong),
        )
    except AnswersInvalid as exc:
        wrong.append(exc)
    if wrong:
        raise AnswersInvalid.every(wrong)
    return answers


def claim_effects(run: RunDocument, spec: ResumeSpec) -> dict[str, Any]:
    """The fields the fresh claim of `spec.attempt` writes (never the consents themselves)."""
    fields: dict[str, Any] = {}
    cp = (run.checkpoint or Checkpoint()).model_copy(deep=True)
    pending = cp.pending_interaction
    if spec.answers and pending is not None:
        cp.outputs[str(pending["node"])] = dict(spec.answers)
        cp.pending_interaction = None
        fields["checkpoint"] = cp.model_dump()
    if spec.budget is not None:
        fields["budget"] = merge_overrides(run.budget, spec.budget).model_dump()
    if spec.workflow is not None and spec.consents.force:
        fields["workflow"] = spec.workflow.model_dump()
    if spec.consents.accept_scratch_loss and run.scratch is not None:
        fields["scratch.forsaken"] = True
    return fields
