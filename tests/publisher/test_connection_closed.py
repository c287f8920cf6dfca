"""nats-py gives up a connection for good (no reconnect) when the server answers `-ERR`, and
calls no error callback for it: `publisher.connection.connect` logs why, so a runner that exits
on a closed connection leaves the server's reason behind (a poison run id past the
control-line limit took the fuzz's runner down, and its log said only "connection closed")."""

from __future__ import annotations

import logging

import pytest

from publisher.config import WireSettings
from publisher.connection import connect
from tests.runner.conftest import eventually
from tests.support.nats_server import NatsServer


async def test_a_connection_the_server_closes_with_an_err_is_logged_with_the_servers_reason(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    nc, _ = await connect(WireSettings(nats_url=nats_server.url), name="test-closed")
    caplog.set_level(logging.WARNING, logger="publisher.connection")
    try:
        await nc.publish("x." + "y" * 8_000, b"")  # past the server's 4 KiB control line

        async def closed_and_said_why() -> bool:
            return nc.is_closed and "control line" in caplog.text

        await eventually(closed_and_said_why, within=10, every=0.01)
    finally:
        await nc.close()
    [record] = [r for r in caplog.records if "connection is closed" in r.getMessage()]
    assert "maximum control line exceeded" in record.getMessage()


async def test_a_connection_closed_by_its_owner_logs_nothing(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="publisher.connection")
    nc, _ = await connect(WireSettings(nats_url=nats_server.url), name="test-closed")
    await nc.close()
    assert nc.is_closed and "connection is closed" not in caplog.text
