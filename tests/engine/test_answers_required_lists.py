"""`answers_required` (SPEC §4 Resume, §6.4): a resume of a `paused_waiting_human` run without
answers names the questions that must be answered — the required ones, never the optional ones
a person may leave out. A node whose questions are all optional still needs one answer (SPEC §4:
no answers at all is `answers_required`); the questions left out become `None`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.errors import AnswersInvalid, AnswersRequired
from engine.loader import LoadedWorkflow, load_workflow
from engine.local import LocalEnv, resume_local, run_local
from engine.resume import ResumeRequest, judge_resume
from store import RunStatus

OPTIONAL_ONLY = load_workflow(
    """
name: optional_only
entry: ask
nodes:
  ask:
    kind: human
    message: anything to add?
    questions:
      - name: note
        type: string
        required: false
      - name: count
        type: int
        required: false
  done:
    kind: compute
    set:
      note: outputs.ask.note or 'none'
edges:
  - from: ask
    to: done
""",
    "optional_only.yaml",
)


async def test_answers_required_names_only_the_required_questions(
    env: LocalEnv, load: Callable[[str], LoadedWorkflow]
) -> None:
    paused = await run_local(env, load("examples/approval"), {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN

    with pytest.raises(AnswersRequired) as info:
        judge_resume(paused, ResumeRequest())

    # `approval` asks `approved` (required) and `note` (optional).
    assert info.value.missing == ("approved",)
    assert info.value.message == "answers required: approved"
    assert info.value.code == "answers_required"


async def test_answers_required_when_a_node_whose_questions_are_all_optional_gets_no_answer(
    env: LocalEnv,
) -> None:
    """SPEC §4: `paused_waiting_human` resumed without answers is refused, whatever the
    questions say; one answer is enough for an all-optional node, the rest become `None`."""
    paused = await run_local(env, OPTIONAL_ONLY, {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN

    with pytest.raises(AnswersRequired) as info:
        judge_resume(paused, ResumeRequest())
    assert info.value.missing == ("note", "count")
    assert "at least one answer" in info.value.message

    done = await resume_local(env, paused.run_id, ResumeRequest(cli_answers={"note": "fine"}))

    assert done.status is RunStatus.FINISHED, (done.failure_code, done.error)
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["ask"] == {"note": "fine", "count": None}
    assert done.checkpoint.outputs["done"] == {"note": "fine"}


async def test_answers_invalid_when_the_run_is_not_waiting_for_answers(
    env: LocalEnv, load: Callable[[str], LoadedWorkflow]
) -> None:
    """An answer given to a run that asks nothing (here: failed_resumable at the budget guard)
    would be dropped without a word; it is refused, naming the answer."""
    stopped = await run_local(env, load("examples/budget_guard"), {})
    assert stopped.status is RunStatus.FAILED_RESUMABLE

    with pytest.raises(AnswersInvalid) as info:
        judge_resume(stopped, ResumeRequest(cli_answers={"approved": "yes"}))

    assert info.value.code == "answers_invalid"
    assert info.value.field == "approved"
    assert "not waiting for answers" in info.value.message
    # The remedy is this case's, not "correct the named answer" (found by a walkthrough).
    assert (info.value.remedy or "").startswith("resume it without answers")
    judge_resume(stopped, ResumeRequest())  # without answers it resumes


MIXED = load_workflow(
    """
name: mixed
entry: ask
nodes:
  ask:
    kind: human
    message: three questions
    questions:
      - name: n
        type: int
      - name: m
        type: string
      - name: ok
        type: bool
        required: false
""",
    "mixed.yaml",
)


async def test_every_wrong_answer_is_named_when_cli_strings_and_typed_answers_mix(
    env: LocalEnv,
) -> None:
    """`--answer` strings are parsed before the typed answers are checked: one that did not
    parse used to end the judgement there, hiding a missing answer and a wrong typed one."""
    paused = await run_local(env, MIXED, {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN

    with pytest.raises(AnswersInvalid) as info:
        judge_resume(paused, ResumeRequest(cli_answers={"n": "abc"}, answers={"ok": "x"}))

    named = [name for name, _ in info.value.problems]
    assert sorted(named) == ["m", "n", "ok"]  # each once: `n` for its text, not also as missing
    assert "expected an int" in info.value.message and "is required" in info.value.message


async def test_a_cli_answer_that_does_not_parse_is_named_even_when_it_is_the_only_one(
    env: LocalEnv,
) -> None:
    paused = await run_local(env, MIXED, {})
    with pytest.raises(AnswersInvalid) as info:
        judge_resume(paused, ResumeRequest(cli_answers={"n": "abc"}))
    assert sorted(name for name, _ in info.value.problems) == ["m", "n"]
