"""The `nats_server` fixture: a working JetStream that keeps its data across stop()/start()."""

from __future__ import annotations

import socket

import nats
import pytest
from nats.js.api import StreamConfig

from tests.support.nats_server import NatsServer


async def test_jetstream_publish_and_pull_round_trip(nats_server: NatsServer, nats_prefix: str):
    assert nats_server.url.startswith("nats://127.0.0.1:")
    stream, subject = f"{nats_prefix}_SMOKE", f"{nats_prefix}.smoke"
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[subject]))
        ack = await js.publish(subject, b"hello")
        assert (ack.stream, ack.seq) == (stream, 1)

        sub = await js.pull_subscribe(subject, durable=f"{nats_prefix}_reader", stream=stream)
        msgs = await sub.fetch(1, timeout=5)
        assert [m.data for m in msgs] == [b"hello"]
        assert msgs[0].metadata.sequence.stream == 1
        await msgs[0].ack_sync()
        await js.delete_stream(stream)
    finally:
        await nc.close()


async def test_stop_and_start_keep_port_and_jetstream_data(
    nats_server: NatsServer, nats_prefix: str
):
    stream, subject = f"{nats_prefix}_KEEP", f"{nats_prefix}.keep"
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[subject]))
        for i in range(3):
            await js.publish(subject, f"m{i}".encode())
    finally:
        await nc.close()

    port, url = nats_server.port, nats_server.url
    try:
        nats_server.stop()
        assert not nats_server.running
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        nats_server.start()
    assert nats_server.running
    assert (nats_server.port, nats_server.url) == (port, url)

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        assert info.state.messages == 3
        sub = await js.pull_subscribe(subject, durable=f"{nats_prefix}_reader", stream=stream)
        msgs = await sub.fetch(3, timeout=5)
        assert [m.data for m in msgs] == [b"m0", b"m1", b"m2"]
        for msg in msgs:
            await msg.ack_sync()
        await js.delete_stream(stream)
    finally:
        await nc.close()
