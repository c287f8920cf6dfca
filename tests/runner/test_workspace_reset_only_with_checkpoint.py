"""SPEC §5.3: after its CAS wins, a claim emits `run_claimed` and, *when a checkpoint exists*,
`run_workspace_reset`.

A run's first execution has no earlier workspace to reset; an event saying otherwise misleads
whoever reads the timeline (the console merges it with the deliveries). The audit made every
claim emit it and no test noticed: only the positive case was asserted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from runner.runner import Runner
from tests.runner.callables import bound_drain
from tests.runner.conftest import Fleet

HELLO = """\
name: hello
entry: a
nodes:
  a:
    kind: compute
    set:
      x: "1 + 1"
"""


@pytest.fixture
async def runner(fleet: Fleet) -> AsyncIterator[Runner]:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    yield runner
    bound_drain(fleet.runners)


async def test_spec_5_3_a_fresh_first_claim_writes_no_run_workspace_reset(
    fleet: Fleet, runner: Runner
) -> None:
    launched = await fleet.launch(HELLO)
    assert launched.checkpoint is None

    await fleet.wait_status(launched.run_id, "finished")

    events = await fleet.store.read_events(launched.run_id)
    claims = [e.data["path"] for e in events if e.type == "run_claimed"]
    assert claims == ["fresh"]
    assert "run_workspace_reset" not in [e.type for e in events]
