"""`ensure_streams` (SPEC §3): the streams and consumers of the contract, created once,
updated in place where JetStream allows, refused where it does not."""

from __future__ import annotations

import pytest
from nats.js.api import AckPolicy, RetentionPolicy, StorageType, StreamConfig

from publisher import StreamConfigConflict, WireNames, ensure_streams
from tests.publisher.conftest import Nats, wire_settings

SEVEN_DAYS_S = 7 * 24 * 3600


def every_name(names: WireNames) -> set[str]:
    return {
        names.runs_stream,
        f"{names.runs_stream}/{names.consumer}",
        names.advisory_stream,
        f"{names.advisory_stream}/{names.backstop_consumer}",
        names.dlq_stream,
        names.delivery_stream,
    }


async def test_ensure_creates_the_work_stream_with_the_contract_settings(
    nats_conn: Nats, names: WireNames
):
    report = await ensure_streams(nats_conn.js, names, wire_settings())
    assert set(report.created) == every_name(names)
    assert report.updated == []

    cfg = (await nats_conn.js.stream_info(names.runs_stream)).config
    assert cfg.subjects == [names.runs_subject]
    assert cfg.retention == RetentionPolicy.WORK_QUEUE
    assert cfg.storage == StorageType.FILE
    assert not cfg.max_age  # no max age: the sweeper handles orphans
    assert cfg.duplicate_window == pytest.approx(300.0)
    assert cfg.num_replicas == 1


async def test_ensure_creates_the_runners_consumer_with_ack_wait_ttl_plus_skew(
    nats_conn: Nats, names: WireNames
):
    await ensure_streams(nats_conn.js, names, wire_settings(lease_ttl="30s", lease_skew="2s"))
    cfg = (await nats_conn.js.consumer_info(names.runs_stream, names.consumer)).config
    assert cfg.durable_name == names.consumer
    assert cfg.ack_policy == AckPolicy.EXPLICIT
    assert cfg.ack_wait == pytest.approx(32.0)
    assert cfg.max_deliver == 10
    assert cfg.max_ack_pending == -1
    assert cfg.filter_subject == names.runs_subject


async def test_ack_wait_follows_the_lease_settings(nats_conn: Nats, names: WireNames):
    await ensure_streams(nats_conn.js, names, wire_settings(lease_ttl="45s", lease_skew="3s"))
    cfg = (await nats_conn.js.consumer_info(names.runs_stream, names.consumer)).config
    assert cfg.ack_wait == pytest.approx(48.0)


async def test_ensure_creates_the_advisory_stream_and_backstop_consumer(
    nats_conn: Nats, names: WireNames
):
    await ensure_streams(nats_conn.js, names, wire_settings())
    cfg = (await nats_conn.js.stream_info(names.advisory_stream)).config
    assert cfg.subjects == [
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{names.runs_stream}.{names.consumer}"
    ]
    assert cfg.retention == RetentionPolicy.LIMITS
    assert cfg.storage == StorageType.FILE
    assert cfg.max_age == pytest.approx(SEVEN_DAYS_S)

    backstop = (
        await nats_conn.js.consumer_info(names.advisory_stream, names.backstop_consumer)
    ).config
    assert backstop.durable_name == names.backstop_consumer
    assert backstop.ack_policy == AckPolicy.EXPLICIT


async def test_ensure_creates_the_dlq_stream_keeping_one_record_per_sequence(
    nats_conn: Nats, names: WireNames
):
    await ensure_streams(nats_conn.js, names, wire_settings())
    cfg = (await nats_conn.js.stream_info(names.dlq_stream)).config
    assert cfg.subjects == [names.dlq_subject("*")]
    assert cfg.retention == RetentionPolicy.LIMITS
    assert cfg.storage == StorageType.FILE
    assert cfg.max_msgs_per_subject == 1
    assert not cfg.max_age

    # Recording twice replaces: one message per subject survives.
    await nats_conn.js.publish(names.dlq_subject(7), b"first")
    await nats_conn.js.publish(names.dlq_subject(7), b"second")
    info = await nats_conn.js.stream_info(names.dlq_stream)
    assert info.state.messages == 1
    last = await nats_conn.js.get_last_msg(names.dlq_stream, names.dlq_subject(7))
    assert last.data == b"second"


async def test_ensure_twice_creates_and_updates_nothing(nats_conn: Nats, names: WireNames):
    settings = wire_settings()
    await ensure_streams(nats_conn.js, names, settings)
    again = await ensure_streams(nats_conn.js, names, settings)
    assert again.created == []
    assert again.updated == []


async def test_a_changed_mutable_setting_is_updated_in_place(nats_conn: Nats, names: WireNames):
    await ensure_streams(nats_conn.js, names, wire_settings())
    await nats_conn.js.publish(names.runs_subject, b"kept")

    report = await ensure_streams(nats_conn.js, names, wire_settings(max_deliver=5))

    assert report.created == []
    assert report.updated == [f"{names.runs_stream}/{names.consumer}"]
    cfg = (await nats_conn.js.consumer_info(names.runs_stream, names.consumer)).config
    assert cfg.max_deliver == 5
    # Updated, not recreated: the stream's messages are still there.
    assert (await nats_conn.js.stream_info(names.runs_stream)).state.messages == 1


async def test_a_changed_duplicate_window_updates_the_work_stream(
    nats_conn: Nats, names: WireNames
):
    await ensure_streams(nats_conn.js, names, wire_settings())
    report = await ensure_streams(nats_conn.js, names, wire_settings(duplicate_window="10m"))
    assert report.updated == [names.runs_stream]
    cfg = (await nats_conn.js.stream_info(names.runs_stream)).config
    assert cfg.duplicate_window == pytest.approx(600.0)


async def test_an_existing_stream_with_another_retention_is_a_conflict_left_untouched(
    nats_conn: Nats, names: WireNames
):
    await nats_conn.js.add_stream(
        StreamConfig(
            name=names.runs_stream,
            subjects=[names.runs_subject],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
        )
    )
    await nats_conn.js.publish(names.runs_subject, b"precious")
    before = (await nats_conn.js.stream_info(names.runs_stream)).config

    with pytest.raises(StreamConfigConflict, match="retention"):
        await ensure_streams(nats_conn.js, names, wire_settings())

    info = await nats_conn.js.stream_info(names.runs_stream)
    assert info.config == before
    assert info.config.retention == RetentionPolicy.LIMITS
    assert info.state.messages == 1
    assert info.state.consumer_count == 0  # nothing was built on the contradicting stream
