"""The shortest path through the fleet: launch → a runner claims → finished → acked."""

from __future__ import annotations

from tests.runner.conftest import Fleet

HELLO = """
name: hello
entry: a
nodes:
  a:
    kind: compute
    set: {x: "1 + 1"}
"""


async def test_launched_run_is_claimed_fresh_finished_and_acked(fleet: Fleet) -> None:
    runner = await fleet.start_runner()
    run = await fleet.launch(HELLO)
    done = await fleet.wait_status(run.run_id, "finished")
    assert done.checkpoint is not None and done.checkpoint.outputs["a"] == {"x": 2}
    assert done.lease is None
    events = [e.type for e in await fleet.store.read_events(run.run_id)]
    assert events[:3] == ["run_launched", "run_queued", "run_claimed"] or "run_claimed" in events
    assert events[-1] == "run_finished"
    assert await fleet.queue_drained()  # work-queue: acked means gone
    assert runner.metrics.claims.labels(path="fresh", outcome="won")._value.get() == 1
