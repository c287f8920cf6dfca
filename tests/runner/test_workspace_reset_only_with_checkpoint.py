"""SPEC §5.3: after its CAS wins, a claim emits `run_claimed` and, *when a checkpoint exists*,
`run_workspace_reset`.

A run's first execution has no earlier workspace to reset; an event saying otherwise misleads
whoever reads the timeline (the console merges it with the deliveries). The audit made every
claim emit it and no test noticed: only the positive case was asserted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.local import new_run_id
from runner.runner import Runner
from tests.runner.callables import body, bound_drain, failed_at_hold, publish_raw, release, workflow
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


async def test_spec_5_3_run_workspace_reset_is_appended_at_claim_only_when_a_checkpoint_exists(
    fleet: Fleet, gates: Path
) -> None:
    """The same runner claims a run with a checkpoint (an auto-retry of a transient failure)
    and one without (a fresh launch): only the first says its workspace was reset, right after
    its `run_claimed`."""
    await fleet.start_runner(sweeper=False, backstop=False)
    retried = new_run_id()
    await fleet.store.create_run(failed_at_hold(retried, gates, "SANDBOX_LOST"))
    release(gates, retried)  # `hold` returns at once
    await publish_raw(
        fleet.js, fleet.names.runs_subject, body(retried, 1), run_id=retried, attempt=1
    )
    fresh = await fleet.publisher.launch(workflow("hello"), {}, tenant="default")
    assert fresh.checkpoint is None

    await fleet.wait_status(retried, "finished")
    await fleet.wait_status(fresh.run_id, "finished")

    with_checkpoint = [e.type for e in await fleet.store.read_events(retried)]
    claimed = with_checkpoint.index("run_claimed")
    assert with_checkpoint[claimed : claimed + 2] == ["run_claimed", "run_workspace_reset"]
    assert with_checkpoint.count("run_workspace_reset") == 1
    without = [e.type for e in await fleet.store.read_events(fresh.run_id)]
    assert "run_claimed" in without
    assert "run_workspace_reset" not in without
