"""A launch's publication record (SPEC §4 Launch: after the PubAck, record `publication`),
written a moment later and only where no claim recorded the copy first (issue 19,
`publisher/launch_records.py`). Real JetStream, real run stores."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

import pytest
from nats.js.api import PubAck

from publisher import Publisher
from store import Eq, Publication, RunDocument, RunQuery, RunStore, Update, utcnow
from tests.engine.conftest import poll_until
from tests.publisher.conftest import example

BOTH_STORES = pytest.mark.parametrize("run_store", ["sqlite", "mongomock"], indirect=True)


async def _launch(publisher: Publisher, n: int = 1) -> list[RunDocument]:
    return [await publisher.launch(example("hello.yaml"), {}, tenant="default") for _ in range(n)]


async def _claim_copy(store: RunStore, run: RunDocument) -> None:
    """What a claim writes of the publication (SPEC §5.3): the whole object, its `msg_id` not
    known to the runner."""
    assert run.publication is not None
    claimed = Publication(attempt=1, stream_seq=run.publication.stream_seq, at=utcnow())
    await store.update_run(
        run.run_id, [Eq("attempt", 1)], Update(set={"publication": claimed.model_dump()})
    )


def _count_writes(publisher: Publisher) -> list[str]:
    written: list[str] = []
    write = publisher.launch_records.write

    async def counted(run: RunDocument, ack: PubAck, at: datetime) -> object:
        written.append(run.run_id)
        return await write(run, ack, at)

    publisher.launch_records.write = counted
    return written


async def _until_recorded(store: RunStore, run: RunDocument) -> None:
    await poll_until(
        lambda: store.get_run(run.run_id),
        lambda doc: doc.publication == run.publication,
        what="the publication record landing",
    )


@BOTH_STORES
async def test_launch_records_the_publication_after_its_delay_without_a_flush(
    publisher: Publisher, run_store: RunStore
) -> None:
    publisher.launch_records.delay_s = 0.2
    (run,) = await _launch(publisher)
    assert publisher.launch_records.pending == 1
    assert (await run_store.get_run(run.run_id)).publication is None
    await _until_recorded(run_store, run)
    assert publisher.launch_records.pending == 0


@BOTH_STORES
async def test_launch_record_is_skipped_when_a_claim_recorded_the_copy_first(
    publisher: Publisher, run_store: RunStore
) -> None:
    """The skip is the case the record's CAS would refuse: the claimed run keeps the claim's
    publication, a run whose attempt moved on keeps its own, and only the third is written."""
    publisher.launch_records.delay_s = 3600.0
    claimed, moved_on, plain = await _launch(publisher, 3)
    await _claim_copy(run_store, claimed)
    await run_store.update_run(moved_on.run_id, [Eq("attempt", 1)], Update(set={"attempt": 2}))
    written = _count_writes(publisher)
    await asyncio.wait_for(publisher.flush(), 10)
    assert written == [plain.run_id]
    assert (await run_store.get_run(plain.run_id)).publication == plain.publication
    kept = (await run_store.get_run(claimed.run_id)).publication
    assert kept is not None and kept.msg_id is None  # the claim's, not overwritten
    assert (await run_store.get_run(moved_on.run_id)).publication is None


@BOTH_STORES
async def test_flush_writes_the_pending_launch_records_at_once_with_one_read(
    publisher: Publisher, run_store: RunStore
) -> None:
    publisher.launch_records.delay_s = 3600.0
    runs = await _launch(publisher, 4)
    reads = 0
    list_run_copies = run_store.list_run_copies

    async def counted(query: RunQuery) -> Any:
        nonlocal reads
        reads += 1
        return await list_run_copies(query)

    run_store.list_run_copies = counted  # type: ignore[method-assign]
    await asyncio.wait_for(publisher.flush(), 10)
    assert reads == 1
    for run in runs:
        assert (await run_store.get_run(run.run_id)).publication == run.publication


async def test_a_launch_record_whose_read_fails_is_logged_and_left_to_the_sweeper(
    publisher: Publisher, run_store: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing raises into the producer; the run keeps no record, which the sweeper's
    missing-publication rule repairs (SPEC §5.7)."""
    publisher.launch_records.delay_s = 3600.0
    (run,) = await _launch(publisher)

    async def down(query: RunQuery) -> Any:
        raise ConnectionError("store down")

    run_store.list_run_copies = down  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="publisher.launch_records"):
        await asyncio.wait_for(publisher.flush(), 10)
    assert "the sweeper repairs them" in caplog.text
    assert publisher.launch_records.pending == 0
    assert (await run_store.get_run(run.run_id)).publication is None


async def test_a_flush_cancelled_mid_write_leaves_the_record_to_land(
    publisher: Publisher, run_store: RunStore
) -> None:
    """The caller gave up waiting; the record it was waiting for is still written."""
    publisher.launch_records.delay_s = 3600.0
    (run,) = await _launch(publisher)
    entered, release = asyncio.Event(), asyncio.Event()
    write = publisher.launch_records.write

    async def gated(doc: RunDocument, ack: PubAck, at: datetime) -> object:
        entered.set()
        await release.wait()
        return await write(doc, ack, at)

    publisher.launch_records.write = gated
    flushing = asyncio.ensure_future(publisher.flush())
    await asyncio.wait_for(entered.wait(), 10)
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing
    release.set()
    await _until_recorded(run_store, run)
