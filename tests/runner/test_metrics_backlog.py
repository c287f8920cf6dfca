"""The consumer's gauges on a runner whose slots are all taken (SPEC §5.8 `num_ack_pending`).
Found by an autoscaling walkthrough: the gauge was read only after a fetch, and a full runner
fetches nothing, so it held a stale value for as long as long runs filled its slots; and no
runner metric showed the backlog (`num_pending`) an autoscaler scales on."""

from __future__ import annotations

from runner.runner import Runner
from tests.runner.conftest import Fleet, eventually

LONG = """\
name: long
entry: wait
nodes:
  wait:
    kind: tool
    run: sleep 60
"""


def sample(runner: Runner, name: str) -> float | None:
    return runner.metrics.registry.get_sample_value(name)


async def test_a_full_runner_still_reads_the_backlog_and_the_held_messages(fleet: Fleet) -> None:
    runner = await fleet.start_runner(slots=1)
    first = await fleet.launch(LONG)
    await fleet.wait_status(first.run_id, "running")
    await eventually(lambda: _is(sample(runner, "runfleet_free_slots"), 0.0))
    # The runner is full now: these two wait on the queue, and it fetches nothing more.
    for _ in range(2):
        await fleet.launch(LONG)

    await eventually(lambda: _is(sample(runner, "runfleet_num_pending"), 2.0), within=20)
    await eventually(lambda: _is(sample(runner, "runfleet_num_ack_pending"), 1.0), within=20)


async def _is(value: float | None, expected: float) -> bool:
    return value == expected
