"""A publish's retries (SPEC §4: bounded retries within `publish_retry_budget`): the first try
runs without the retry machinery, and the tries after a retryable failure keep the schedule one
tenacity loop over all of them would (0.1 s, then doubling), the attempt cap and the budget."""

from __future__ import annotations

import time
from typing import Any

import nats.errors
import pytest
from nats.js.api import PubAck

from publisher import Publisher, PublishFailed
from tests.publisher.conftest import example, wire_settings


class FlakyJs:
    """The real JetStream context, failing its first `failures` publishes with `error`."""

    def __init__(self, inner: Any, failures: int, error: Exception) -> None:
        self.inner = inner
        self.failures = failures
        self.error = error
        self.calls: list[float] = []

    async def publish(self, *args: Any, **kwargs: Any) -> PubAck:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise self.error
        ack: PubAck = await self.inner.publish(*args, **kwargs)
        return ack

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def flaky(publisher: Publisher, failures: int, error: Exception, **settings: Any) -> FlakyJs:
    js = FlakyJs(publisher.js, failures, error)
    publisher.js = js  # type: ignore[assignment]
    publisher.settings = wire_settings(**settings)
    return js


async def test_a_publish_that_fails_retryably_is_tried_again_after_0_1_then_0_2_seconds(
    publisher: Publisher,
) -> None:
    js = flaky(
        publisher, 2, nats.errors.TimeoutError(), publish_attempts=3, publish_retry_budget="5s"
    )
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    assert run.publication is not None and run.publication.stream_seq == 1
    assert len(js.calls) == 3
    gaps = [b - a for a, b in zip(js.calls, js.calls[1:], strict=False)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2, gaps


@pytest.mark.parametrize("attempts", [3, 1], ids=["three_tries", "one_try_never_retried"])
async def test_a_publish_stops_at_its_attempt_cap(publisher: Publisher, attempts: int) -> None:
    js = flaky(
        publisher,
        10,
        nats.errors.TimeoutError(),
        publish_attempts=attempts,
        publish_retry_budget="5s",
    )
    with pytest.raises(PublishFailed, match=f"after {attempts} tries"):
        await publisher.launch(example("hello.yaml"), {}, tenant="default")
    assert len(js.calls) == attempts


async def test_a_publish_is_not_retried_after_a_try_that_failed_past_its_retry_budget(
    publisher: Publisher,
) -> None:
    """Budget 0.25 s, cap 10: tries at 0, 0.1 and 0.3 s; the third fails past the budget, so
    there is no fourth (tenacity's `stop_after_delay`, judged after each failed try)."""
    js = flaky(
        publisher, 10, nats.errors.TimeoutError(), publish_attempts=10, publish_retry_budget="0.25s"
    )
    with pytest.raises(PublishFailed):
        await publisher.launch(example("hello.yaml"), {}, tenant="default")
    assert len(js.calls) == 3


async def test_a_publish_error_that_is_not_retryable_is_tried_once(publisher: Publisher) -> None:
    js = flaky(publisher, 10, nats.errors.BadSubjectError(), publish_attempts=5)
    with pytest.raises(PublishFailed, match="after 1 tries"):
        await publisher.launch(example("hello.yaml"), {}, tenant="default")
    assert len(js.calls) == 1
