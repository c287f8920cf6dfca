"""Publishing to a replicated runs stream (issue 21; nats-server 2.15.1 clustered).

On a cluster a publication is *in process* from the moment the stream's leader proposes it to
its raft group until the group commits it. A second publish with the same `Nats-Msg-Id` in that
moment is not answered `duplicate` but refused: `409 err_code 10158 "duplicate message id is in
process"` (a single server stores synchronously and never answers it). It is what a retry meets
when its first try landed late — a try that timed out and was sent again by nats-py after a
reconnect (`tests/test_nats_hung_server.py`), or a republish racing another publisher's copy of
the same attempt. The publisher asks again (the next answer is the duplicate, with the
sequence), and judges "was this id used before?" only by the tries whose copy could be its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from publisher import DlqStore, Publisher, WireNames, ensure_streams
from publisher.connection import connect
from publisher.errors import DuplicatePublication
from publisher.wire import HDR_MSG_ID, msg_id
from store.sqlite import SqliteRunStore
from tests.publisher.conftest import example, wire_settings
from tests.support.nats_cluster import Cluster, leader_other_than, nats_cluster

__all__ = ["nats_cluster"]  # the module-scoped fixture, imported for this module's tests

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]


@pytest.fixture
async def on_cluster(
    nats_cluster: Cluster, nats_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[Publisher, Client, JetStreamContext]]:
    settings = wire_settings(
        nats_url=nats_cluster.url, namespace=nats_prefix, stream_replicas=3, publish_attempts=3
    )
    names = WireNames(nats_prefix)
    nc, js = await connect(settings, name="test-publish-cluster")
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    try:
        await ensure_streams(js, names, settings)
        # The runs stream led before a test publishes (its create answers before a leader
        # that took over from an earlier test's step-down has its subscription: a 503).
        async with nats_cluster.client() as (watcher, _):
            await leader_other_than(watcher, names.runs_stream, None, exclude=None)
        yield (
            Publisher(
                store=store,
                nc=nc,
                js=js,
                settings=settings,
                names=names,
                dlq=DlqStore(js, names, None),
            ),
            nc,
            js,
        )
    finally:
        await store.close()
        await nc.close()


async def test_a_retry_that_finds_its_msg_id_in_process_is_asked_again_and_answered_duplicate(
    on_cluster: tuple[Publisher, Client, JetStreamContext],
) -> None:
    publisher, _, js = on_cluster
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    names = publisher.names
    headers = {HDR_MSG_ID: msg_id(run.run_id, run.attempt, 1)}
    other, ours = await asyncio.gather(
        js.publish(names.runs_subject, b"{}", headers=headers),
        publisher.publish(run, "sweep", sweep=1, expect_new=False),
    )

    assert ours.duplicate is True and ours.seq == other.seq
    assert (await js.stream_info(names.runs_stream)).state.messages == 2  # launch + one copy


async def test_a_first_publish_whose_msg_id_is_in_process_elsewhere_is_a_duplicate_publication(
    on_cluster: tuple[Publisher, Client, JetStreamContext],
) -> None:
    publisher, _, js = on_cluster
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    names = publisher.names
    headers = {HDR_MSG_ID: msg_id(run.run_id, run.attempt, 2)}
    other, ours = await asyncio.gather(
        js.publish(names.runs_subject, b"{}", headers=headers),
        publisher.publish(run, "sweep", sweep=2),  # a new copy: the id must be unused
        return_exceptions=True,
    )

    assert not isinstance(other, BaseException), other
    assert isinstance(ours, DuplicatePublication), ours
    assert (await js.stream_info(names.runs_stream)).state.messages == 2
