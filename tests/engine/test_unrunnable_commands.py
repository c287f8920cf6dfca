"""A command no `exec` can take (SPEC §6.1 tool nodes, §6.6 classes): a var holding a NUL byte
is refused at launch (`vars_invalid`); a rendered command holding one, or longer than one
command line may be, fails its node `TOOL_FAILED_PERMANENT` before any sandbox is asked.
Both were a `SandboxLost` (transient): retried, naked, auto-resumed to the same end (found by
a workflow author's walkthrough)."""

from __future__ import annotations

import pytest

from engine.failures import FailureCode
from engine.loader import load_workflow
from engine.local import LocalEnv, run_local
from engine.nodes import MAX_COMMAND_BYTES
from engine.vars import VarsInvalid
from store import RunQuery, RunStatus, RunStore

ECHO = """\
name: echo
entry: say
vars:
  text: {type: string}
  count: {type: int, default: 1}
nodes:
  say:
    kind: tool
    run: "printf %s {{ vars.text }} | wc -c"
"""

NUL_FROM_AN_OUTPUT = """\
name: nul
entry: make
nodes:
  make:
    kind: tool
    run: "printf '{\\"v\\": \\"a\\\\u0000b\\"}'"
    output: json
  use:
    kind: tool
    run: "echo {{ outputs.make.v }}"
edges:
  - {from: make, to: use}
"""


@pytest.mark.parametrize("inputs", [{"text": "a\x00b"}, {"text": "ok", "count": "1\x00"}])
async def test_a_var_holding_a_nul_byte_is_refused_at_launch(
    env: LocalEnv, store: RunStore, inputs: dict[str, object]
) -> None:
    with pytest.raises(VarsInvalid, match="NUL byte"):
        await run_local(env, load_workflow(ECHO, "echo.yaml"), inputs)
    assert (await store.list_runs(RunQuery(tenant="default"))).runs == []


async def test_a_command_holding_a_nul_byte_fails_its_node_for_good(env: LocalEnv) -> None:
    doc = await run_local(env, load_workflow(NUL_FROM_AN_OUTPUT, "nul.yaml"), {})

    assert doc.status is RunStatus.FAILED, doc.error
    assert doc.failure_code == FailureCode.TOOL_FAILED_PERMANENT
    assert doc.error is not None and "use: the command holds a NUL byte" in doc.error


async def test_a_command_longer_than_a_command_line_fails_its_node_for_good(
    env: LocalEnv,
) -> None:
    doc = await run_local(
        env, load_workflow(ECHO, "echo.yaml"), {"text": "x" * (MAX_COMMAND_BYTES + 1)}
    )

    assert doc.status is RunStatus.FAILED, doc.error
    assert doc.failure_code == FailureCode.TOOL_FAILED_PERMANENT
    assert doc.error is not None and "over the 131071 one command line can carry" in doc.error


async def test_a_command_just_under_the_bound_runs(env: LocalEnv) -> None:
    """The bound is the kernel's, not a guess below it: a command at it runs."""
    text = "x" * (MAX_COMMAND_BYTES - len("printf %s  | wc -c") - 2)

    doc = await run_local(env, load_workflow(ECHO, "echo.yaml"), {"text": text})

    assert doc.status is RunStatus.FINISHED, doc.error
