"""A publication the runs stream's dedupe window answers `duplicate` is logged (issue 21): the
copy had landed, and a retry or a sweeper republish under the same `Nats-Msg-Id` was not stored
twice. Operators see it in the runner's log; the cluster soak counts these lines
(`tests/soak_soundings.py`) for its table ("duplicate publications answered by dedupe").
"""

from __future__ import annotations

import logging

import pytest

from publisher import Publisher
from tests.publisher.conftest import example
from tests.soak_soundings import DedupeCounter, count_dedupe_answers


async def test_a_publication_answered_by_the_dedupe_window_is_logged_and_counted(
    publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    counter = DedupeCounter()
    counter.install()
    try:
        with caplog.at_level(logging.INFO, logger="publisher.publisher"):
            again = await publisher.publish(run, "sweep", expect_new=False)
            new_copy = await publisher.publish(run, "sweep", sweep=1)
    finally:
        counter.remove()

    assert again.duplicate is True and new_copy.duplicate is not True
    assert counter.count == 1  # the duplicate answer only; the new copy is not one
    assert count_dedupe_answers([caplog.text]) == 1
    assert f"run {run.run_id}: publication of attempt 1 answered duplicate" in caplog.text
