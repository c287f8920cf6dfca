"""The tests use the product's own local server wrapper (`runner.localnats`)."""

from runner.localnats import NatsServer, find_nats_server

__all__ = ["NatsServer", "find_nats_server"]
