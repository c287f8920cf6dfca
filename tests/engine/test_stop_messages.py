"""A human or fail node's `message` that does not render (a typo in a field) still makes its
stop — the pause for a person, the workflow's own failure — with the raw text, and the error
is said beside it (docs/workflows.md, "Templates and quoting"). Found by a workflow
walkthrough: the raw `{{ outputs.a.missing }}` was shown with no word of why."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from engine.loader import load_workflow
from engine.local import LocalEnv, run_local
from store import Event, RunStatus

STOPS = """\
name: stops
entry: a
vars:
  which: {type: string}
nodes:
  a:
    kind: compute
    set: {n: "1"}
  ask:
    kind: human
    message: "value is {{ outputs.a.missing }}"
    questions: [{name: ok, type: bool}]
  stop:
    kind: fail
    code: MY_STOP
    message: "stop {{ outputs.a.nope }}"
edges:
  - {from: a, to: ask, when: "vars.which == 'msg'"}
  - {from: a, to: stop, when: "vars.which == 'fail'"}
"""


async def test_a_human_message_that_does_not_render_pauses_and_says_why(
    env: LocalEnv, events: Callable[[str], Awaitable[list[Event]]]
) -> None:
    paused = await run_local(env, load_workflow(STOPS, "stops.yaml"), {"which": "msg"})

    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN
    (asked,) = [e for e in await events(paused.run_id) if e.type == "human_input_requested"]
    assert asked.data["message"] == "value is {{ outputs.a.missing }}"
    assert "missing" in asked.data["message_error"]


async def test_a_fail_message_that_does_not_render_fails_with_its_code_and_says_why(
    env: LocalEnv,
) -> None:
    failed = await run_local(env, load_workflow(STOPS, "stops.yaml"), {"which": "fail"})

    assert (failed.status, failed.failure_code) == (RunStatus.FAILED, "MY_STOP")
    assert failed.error is not None
    assert failed.error.startswith("stop {{ outputs.a.nope }} (the message did not render:")
    assert "nope" in failed.error.split("did not render:", 1)[1]
