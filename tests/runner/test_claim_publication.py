"""The claim's `publication` write (SPEC §2, §5.3): every claim points `publication` at the
delivery it claims, and it writes the whole object, so a fresh claim that beats the publisher's
own `publication` write (the parent still null) lands on MongoDB as it does on SQLite.

Real nats-server and publisher; the store is each backend in turn (SQLite, mongomock, and a real
`mongod` when `MONGODB_URI` is set), opened as the conformance suite opens it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import uuid6
from nats.js.api import PubAck

from publisher import Publisher
from runner.admission import DeliveryInfo
from runner.claim import claim
from store import CasConflict, RunDocument, RunStatus, RunStore, utcnow
from store.timeutil import truncate_ms
from tests.runner.callables import new_run
from tests.runner.conftest import Fleet
from tests.store.conftest import MONGO_BACKENDS, open_backend

TTL, SKEW = timedelta(seconds=30), timedelta(seconds=2)


@pytest.fixture(params=["sqlite", *MONGO_BACKENDS])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    async with open_backend(request.param, tmp_path / "store") as backend:
        yield backend.store


@pytest.fixture
def publisher(fleet: Fleet, store: RunStore) -> Publisher:
    """The fleet's publisher and stream, writing to the backend under test."""
    return Publisher(store=store, nc=fleet.nc, js=fleet.js, settings=fleet.wire, names=fleet.names)


async def published(store: RunStore, publisher: Publisher) -> tuple[RunDocument, PubAck]:
    """A queued run at attempt 1 whose message is on the stream, its `publication` not yet
    recorded: the window in which a runner's claim can beat the publisher's write."""
    run = new_run("hello", run_id=str(uuid6.uuid7()), status=RunStatus.QUEUED)
    await store.create_run(run)
    return run, await publisher.publish(run, "launch")


async def fresh_claim(store: RunStore, run: RunDocument, seq: int) -> RunDocument:
    delivery = DeliveryInfo(stream_seq=seq, num_delivered=1, max_deliver=5)
    now = utcnow()
    won = await claim(store, run, "fresh", delivery, owner="runner-a", now=now, ttl=TTL, skew=SKEW)
    assert not isinstance(won, CasConflict)
    assert won.publication is not None and won.publication.at == truncate_ms(now)
    return won


async def test_a_fresh_claim_before_the_publication_write_records_the_whole_publication(
    store: RunStore, publisher: Publisher
) -> None:
    run, ack = await published(store, publisher)
    assert run.publication is None
    won = await fresh_claim(store, run, ack.seq)
    assert won.status is RunStatus.RUNNING
    assert won.publication is not None
    assert won.publication.model_dump(exclude={"at"}) == {
        "attempt": 1,
        "stream_seq": ack.seq,
        "msg_id": None,
    }
    assert (await store.get_run(run.run_id)).publication == won.publication
    # The publisher's write, arriving late, finds the claim's record of that copy and skips.
    assert await publisher.record_publication(run, ack) is None
    assert (await store.get_run(run.run_id)).publication == won.publication


async def test_a_claim_after_the_publication_write_keeps_the_msg_id_of_the_copy_it_claims(
    store: RunStore, publisher: Publisher
) -> None:
    run, ack = await published(store, publisher)
    recorded = await publisher.record_publication(run, ack)
    assert recorded is not None and recorded.publication is not None
    won = await fresh_claim(store, recorded, ack.seq)
    assert won.publication is not None
    assert (won.publication.attempt, won.publication.stream_seq) == (1, ack.seq)
    assert won.publication.msg_id == recorded.publication.msg_id == f"{run.run_id}:1"


async def test_a_claim_of_another_copy_points_the_publication_at_it_without_a_stale_msg_id(
    store: RunStore, publisher: Publisher
) -> None:
    """A sweep republished the run (`…:1:s1`) while the original copy was still delivered:
    the claim of the original names the original's sequence and no longer the sweep's id."""
    run, first = await published(store, publisher)
    again = await publisher.publish(run, "sweep", sweep=1)
    recorded = await publisher.record_publication(run, again, sweep=1)
    assert recorded is not None and recorded.publication is not None
    assert recorded.publication.msg_id == f"{run.run_id}:1:s1"
    won = await fresh_claim(store, recorded, first.seq)
    assert won.publication is not None
    assert (won.publication.stream_seq, won.publication.msg_id) == (first.seq, None)
