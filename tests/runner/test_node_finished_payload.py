"""SPEC §6.3: `node_finished {node, in_sandbox, answered}`.

`in_sandbox` says whether the node ran in the sandbox (what a bank's staleness counts, §7.4)
and `answered` whether a person's answers finished it (a human node). The console's timeline
and `runfleet events` show them; the audit changed them and no test noticed. A tool node, a
compute node and a human node run on a real runner here, and each `node_finished` is read
back from the store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.resume import ResumeRequest
from runner.runner import Runner
from tests.runner.callables import bound_drain
from tests.runner.conftest import Fleet

THREE_KINDS = """\
name: three-kinds
entry: shell
nodes:
  shell:
    kind: tool
    run: "echo hi"
  calc:
    kind: compute
    set:
      x: "1 + 1"
  ask:
    kind: human
    message: "go on?"
    questions:
      - name: ok
        type: bool
edges:
  - from: shell
    to: calc
  - from: calc
    to: ask
"""


@pytest.fixture
async def runner(fleet: Fleet) -> AsyncIterator[Runner]:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    yield runner
    bound_drain(fleet.runners)


async def test_spec_6_3_node_finished_carries_node_in_sandbox_and_answered(
    fleet: Fleet, runner: Runner
) -> None:
    launched = await fleet.launch(THREE_KINDS)
    await fleet.wait_status(launched.run_id, "paused_waiting_human")
    await fleet.publisher.resume(
        launched.run_id, ResumeRequest(answers={"ok": True}), tenant="default"
    )
    await fleet.wait_status(launched.run_id, "finished")

    finished: dict[str, dict[str, Any]] = {
        e.data["node"]: e.data
        for e in await fleet.store.read_events(launched.run_id)
        if e.type == "node_finished"
    }
    assert finished == {
        "shell": {"node": "shell", "in_sandbox": True, "answered": False},
        "calc": {"node": "calc", "in_sandbox": False, "answered": False},
        "ask": {"node": "ask", "in_sandbox": False, "answered": True},
    }
