"""The fetch loop's gather (ADR-0015 amendment 2): after a pull that emptied the queue, the
next messages gather for `fetch_gather` before the runner pulls again, so a trickle of runs is
claimed a few at a time instead of one pull, one claim and one commit per run."""

from __future__ import annotations

import pytest

from runner.runner import gather_wait
from tests.runner.callables import WORKFLOWS, sample
from tests.runner.conftest import Fleet, eventually

HELLO = (WORKFLOWS / "hello.yaml").read_text()
"""One compute node: the shortest run."""


@pytest.mark.parametrize(
    ("delivered", "asked", "wait"),
    [
        (1, 8, 0.004),  # a trickle: the pull emptied the queue
        (7, 8, 0.004),
        (8, 8, 0.0),  # a backlog: the slots bound it, not the gather
        (0, 8, 0.0),  # an idle queue: the next lone run is handed over as it arrives
    ],
)
def test_fetch_gathers_only_after_a_pull_that_delivered_and_emptied_the_queue(
    delivered: int, asked: int, wait: float
) -> None:
    assert gather_wait(delivered, asked, 0.004) == wait
    assert gather_wait(delivered, asked, 0.0) == 0.0  # fetch_gather=0 pulls at once


async def test_runs_launched_while_the_fetch_loop_gathers_arrive_in_one_pull(
    fleet: Fleet,
) -> None:
    runner = await fleet.start_runner(slots=8, fetch_gather="1s")
    registry = runner.metrics.registry

    def pulls() -> float:
        return sample(registry, "runfleet_fetch_messages_count")

    first = await fleet.launch(HELLO)

    async def first_pulled() -> bool:
        return pulls() >= 1

    await eventually(first_pulled, within=10.0, every=0.01)
    # The first pull delivered one message of the eight it asked for: the loop now gathers
    # for 1 s, and these three arrive meanwhile.
    later = [await fleet.launch(HELLO) for _ in range(3)]
    for run in [first, *later]:
        await fleet.wait_status(run.run_id, "finished")
    assert pulls() == 2
    assert sample(registry, "runfleet_fetch_messages_sum") == 4
    assert sample(registry, "runfleet_fetch_messages_bucket", le="2.0") == 1  # the lone first
