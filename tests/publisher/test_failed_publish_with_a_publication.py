"""SPEC §4: a publish that fails after its retries undoes the launch or the resume only when
no `publication` for that attempt exists.

A publish can fail at the client while a copy of the attempt landed anyway and was recorded
(the sweeper's republish of a queued attempt records its sequence; a claim records its
delivery's). That copy carries the run: a resume must not flip it back to its prior status
(CAS on `queued` + the attempt + no `publication` for it), and a launch must not move it to
`failed` `LAUNCH_FAILED` (a CAS that also requires no `publication` for the attempt). The
audit dropped both `publication` conditions and no test noticed.

The JetStream context is the real one; only the answer of the publisher's own publish is
lost: the copy lands, its publication is recorded the way the sweeper records it, and the
publisher is told the publish timed out.
"""

from __future__ import annotations

import contextlib
from typing import Any

import nats.errors
from nats.js.api import PubAck

from engine.resume import ResumeRequest
from publisher import Publisher, PublishFailed
from store import Checkpoint, RunStatus, RunStore
from tests.publisher.conftest import example, put_run, wire_settings


class LandsThenFails:
    """The real JetStream context: each publish lands, the copy's publication is recorded
    (as the sweeper's `record_publication` does), then the publisher hears a timeout."""

    def __init__(self, publisher: Publisher) -> None:
        self.inner = publisher.js
        self.publisher = publisher
        self.landed: list[PubAck] = []

    async def publish(self, subject: str, payload: bytes, **kwargs: Any) -> PubAck:
        ack: PubAck = await self.inner.publish(subject, payload, **kwargs)
        self.landed.append(ack)
        run_id, _, _ = kwargs["headers"]["Nats-Msg-Id"].partition(":")
        run = await self.publisher.store.get_run(run_id)
        await self.publisher.record_publication(run, ack)
        raise nats.errors.TimeoutError

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def losing_answers(publisher: Publisher) -> LandsThenFails:
    js = LandsThenFails(publisher)
    publisher.js = js  # type: ignore[assignment]
    publisher.settings = wire_settings(publish_attempts=1)
    return js


async def test_spec_4_a_failed_resume_publish_flips_back_only_without_a_publication(
    publisher: Publisher, run_store: RunStore
) -> None:
    run = await put_run(
        run_store, status=RunStatus.PAUSED_OPERATOR, checkpoint=Checkpoint(progress=1)
    )
    js = losing_answers(publisher)

    with contextlib.suppress(PublishFailed):
        await publisher.resume(run.run_id, ResumeRequest(), tenant="default")

    assert len(js.landed) == 1
    after = await run_store.get_run(run.run_id)
    assert after.publication is not None and after.publication.attempt == 2
    # The landed copy carries attempt 2: the run stays queued for it, not put back.
    assert (after.status, after.attempt) == (RunStatus.QUEUED, 2)
    types = [e.type for e in await run_store.read_events(run.run_id)]
    assert "run_requeue_failed" not in types


async def test_spec_4_the_launch_failed_cas_requires_no_publication_for_the_attempt(
    publisher: Publisher, run_store: RunStore
) -> None:
    js = losing_answers(publisher)

    with contextlib.suppress(PublishFailed):
        await publisher.launch(example("hello.yaml"), {}, tenant="default", run_id="lands")

    assert len(js.landed) == 1
    after = await run_store.get_run("lands")
    assert after.publication is not None and after.publication.attempt == 1
    assert (after.status, after.failure_code) == (RunStatus.QUEUED, None)
    types = [e.type for e in await run_store.read_events("lands")]
    assert "run_failed" not in types
