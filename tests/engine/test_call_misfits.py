"""`call` nodes whose callables misbehave (SPEC §6.1 `call`, §6.6): each ends as the failure
table says, and neither the runner's loop nor the run's record is theirs to break. Found by a
walkthrough of a call-node author; each failed otherwise on the code before (noted per test).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.failures import FailureCode
from engine.loader import load_workflow
from engine.local import LocalEnv, run_local
from store import RunDocument, RunStatus

M = "tests.engine.call_misfits"


def one_call(function: str, *, timeout: str = "10s", inputs: str = "{}") -> str:
    return f"""\
name: misfit
entry: c
nodes:
  c:
    kind: call
    function: "{M}:{function}"
    timeout: {timeout}
    inputs: {inputs}
    retry: {{max: 0}}
"""


async def run(env: LocalEnv, source: str, inputs: dict[str, Any] | None = None) -> RunDocument:
    return await run_local(env, load_workflow(source, "misfit.yaml"), inputs or {})


async def test_a_plain_function_that_blocks_leaves_the_loop_free_and_times_out(
    env: LocalEnv,
) -> None:
    """Before: `time.sleep` ran on the runner's loop, past its timeout, and stalled the lease
    keeper and every other run on it."""
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.02)

    beside = asyncio.ensure_future(ticker())
    try:
        doc = await run(env, one_call("blocks", timeout="0.5s", inputs="{seconds: 3}"))
    finally:
        stop.set()
        await beside
    assert (doc.status, doc.failure_code) == (RunStatus.FAILED_RESUMABLE, FailureCode.TIMEOUT)
    assert doc.error is not None and "timed out after 0.5s" in doc.error
    assert ticks >= 5  # the loop ran other work while the call blocked its thread


async def test_a_call_that_swallows_its_cancellation_still_times_out(env: LocalEnv) -> None:
    """Before: `asyncio.wait_for` waited for it, and its late result was taken as success."""
    doc = await run(env, one_call("swallows_cancel", timeout="0.3s", inputs="{seconds: 3}"))
    assert (doc.status, doc.failure_code) == (RunStatus.FAILED_RESUMABLE, FailureCode.TIMEOUT)
    assert doc.checkpoint is not None and "c" not in doc.checkpoint.outputs


@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("exits", "SystemExit: 3"),
        ("raises_cancelled", "raised CancelledError without being cancelled"),
        ("unprintable", "Unprintable whose message cannot be shown"),
    ],
)
async def test_a_base_exception_of_a_callable_is_execution_failed_not_the_runners_end(
    env: LocalEnv, function: str, said: str
) -> None:
    """Before: `SystemExit` ended the runner (every run on it with it), a `CancelledError` of
    its own left the run `running`, an unprintable exception was `INTERNAL_ERROR`."""
    doc = await run(env, one_call(function))
    assert doc.status is RunStatus.FAILED_RESUMABLE, doc.error
    assert doc.failure_code == FailureCode.EXECUTION_FAILED
    assert doc.error is not None and said in doc.error


@pytest.mark.parametrize("function", ["returns_object", "returns_nan"])
async def test_a_result_that_is_not_json_fails_schema_validation(
    env: LocalEnv, function: str
) -> None:
    """Before: the status write was refused (`TypeError`), read as the store being down, and
    the run retried to the DLQ with no word of the cause (or stored a bare `NaN`)."""
    doc = await run(env, one_call(function))
    assert (doc.status, doc.failure_code) == (RunStatus.FAILED, FailureCode.SCHEMA_VALIDATION)
    assert doc.error is not None and "cannot be stored as JSON" in doc.error


async def test_the_callables_context_is_a_copy_it_cannot_change_the_run_through(
    env: LocalEnv,
) -> None:
    source = f"""\
name: copies
entry: first
vars:
  who: {{type: string, default: Ada}}
nodes:
  first: {{kind: compute, set: {{n: "1"}}}}
  c: {{kind: call, function: "{M}:mutates_context"}}
  after: {{kind: compute, set: {{n: "outputs.first.n", who: "vars.who"}}}}
edges:
  - {{from: first, to: c}}
  - {{from: c, to: after}}
"""
    doc = await run(env, source)
    assert doc.status is RunStatus.FINISHED, doc.error
    assert doc.checkpoint is not None
    assert doc.checkpoint.outputs["after"] == {"n": 1, "who": "Ada"}
    assert doc.checkpoint.vars == {"who": "Ada"}


async def test_a_cost_that_is_not_a_finite_number_is_refused(env: LocalEnv) -> None:
    """Before: NaN passed every `<` check and switched `max_cost_usd` off."""
    doc = await run(env, one_call("reports_nan"))
    assert doc.failure_code == FailureCode.EXECUTION_FAILED
    assert doc.error is not None and "finite number" in doc.error
    assert doc.checkpoint is not None and doc.checkpoint.usage.cost_usd == 0


@pytest.mark.parametrize("code", ["", "lower_case", "DLQ_PARKED", "BUDGET_EXCEEDED", "BAD\\nCODE"])
async def test_a_permanent_code_the_callable_may_not_give_is_tool_failed_permanent(
    env: LocalEnv, code: str
) -> None:
    """Before: `Permanent("DLQ_PARKED")` faked a parked run, `Permanent("BUDGET_EXCEEDED")`
    paused it for a budget, `Permanent("")` left no code at all."""
    doc = await run(env, one_call("claims_code", inputs=f'{{code: "{code}"}}'))
    assert (doc.status, doc.failure_code) == (RunStatus.FAILED, FailureCode.TOOL_FAILED_PERMANENT)


async def test_a_permanent_code_of_its_own_is_kept(env: LocalEnv) -> None:
    doc = await run(env, one_call("claims_code", inputs='{code: "QUOTA_GONE"}'))
    assert (doc.status, doc.failure_code) == (RunStatus.FAILED, "QUOTA_GONE")


@pytest.mark.parametrize(
    ("function", "said"),
    [("NOT_CALLABLE", "is a int, not a function"), ("wrong_arity", "cannot be called as")],
)
async def test_a_function_that_cannot_be_called_so_is_workflow_invalid(
    env: LocalEnv, function: str, said: str
) -> None:
    """Before: `EXECUTION_FAILED`, retried and auto-resumed to the same end."""
    doc = await run(env, one_call(function))
    assert (doc.status, doc.failure_code) == (RunStatus.FAILED, FailureCode.WORKFLOW_INVALID)
    assert doc.error is not None and said in doc.error


async def test_a_plain_function_sees_the_context_variables_of_the_run_that_calls_it(
    env: LocalEnv,
) -> None:
    """A plain `def` runs on the call threads (ADR-0022), in a copy of the caller's context as
    `asyncio.to_thread` runs its functions: the thread saw none of it (a tracing span, a
    request id), and the protocol model's checks of a node's start were silently skipped."""
    from tests.engine.call_misfits import REQUEST_ID

    REQUEST_ID.set("req-42")
    doc = await run(env, one_call("reads_context"))
    assert doc.status is RunStatus.FINISHED, doc.error
    assert doc.checkpoint is not None and doc.checkpoint.outputs["c"] == {"request_id": "req-42"}
