"""A fleet for runner tests: a real nats-server (the session one), uuid-namespaced streams,
the real SQLite store, in-process runners with short leases, and a publisher.

Short timings keep lease-expiry tests fast without changing any rule: TTL 3 s, refresh every
1 s, skew 0.5 s, loss margin 0.5 s, so `ack_wait` = 3.5 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from engine.config import EngineSettings
from engine.loader import load_workflow
from engine.sandbox.local import LocalSandboxDriver
from publisher import DlqStore, Publisher, WireNames, WireSettings, ensure_streams
from runner.config import RunnerSettings
from runner.runner import Runner
from store import RunDocument, RunStore, lease_is_free, utcnow
from store.blobs_fs import FilesystemBlobStore
from store.sqlite import SqliteRunStore
from tests.support.nats_server import NatsServer

T = TypeVar("T")

LEASE = {
    "lease_ttl": "3s",
    "lease_interval": "1s",
    "lease_skew": "0.5s",
    "lease_loss_margin": "0.5s",
    "node_cancel_budget": "5s",
    "teardown_budget": "10s",
    "scratch_bank_budget": "5s",
    "post_engine_budget": "5s",
    "unwind_margin": "1s",
}


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, within: float = 20.0, every: float = 0.05
) -> T:
    """Poll `probe` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + within
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {within}s (last: {last!r})")


def deliveries(runner: Runner, disposition: str, reason: str) -> float:
    """How many deliveries `runner` disposed of that way (`runfleet_deliveries_total`)."""
    from tests.runner.callables import sample

    return sample(
        runner.metrics.registry, "runfleet_deliveries_total", disposition=disposition, reason=reason
    )


async def reaches(
    runner: Runner, disposition: str, reason: str, n: int = 1, within: float = 10.0
) -> float:
    """Waits until `n` deliveries were disposed of that way; returns when it was seen. A
    disposition follows the store write it settles, so a test counts only after this."""

    async def probe() -> bool:
        return deliveries(runner, disposition, reason) >= n

    await eventually(probe, within=within, every=0.02)
    return time.monotonic()


@dataclass
class Fleet:
    """Everything a runner test touches, all real."""

    tmp: Path
    server: NatsServer
    names: WireNames
    wire: WireSettings
    engine: EngineSettings
    store: RunStore
    blobs: FilesystemBlobStore
    nc: Client
    js: JetStreamContext
    publisher: Publisher
    dlq: DlqStore
    runners: list[Runner] = field(default_factory=list)
    _stack: AsyncExitStack = field(default_factory=AsyncExitStack)

    def env(self) -> dict[str, str]:
        """`RUNFLEET_*` for a runner or CLI subprocess on this fleet."""
        return {
            "RUNFLEET_DATA": str(self.tmp / "data"),
            "RUNFLEET_NATS_URL": self.server.url,
            "RUNFLEET_NAMESPACE": self.names.namespace,
            "RUNFLEET_STORE_URL": f"sqlite:///{self.tmp / 'runs.db'}",
            "RUNFLEET_BLOB_URL": f"file://{self.tmp / 'blobs'}",
            "RUNFLEET_MAX_DELIVER": str(self.wire.max_deliver),
            "RUNFLEET_TRANSIENT_DELAY": "0.2s",
            **{f"RUNFLEET_{k.upper()}": v for k, v in LEASE.items()},
        }

    async def start_runner(self, **settings: Any) -> Runner:
        runner_settings = RunnerSettings(
            **{
                "slots": 4,
                "http_host": "127.0.0.1",
                "transient_delay": "0.2s",
                "lagging_delay": "0.2s",
                **settings,
            }
        )
        runner = Runner(
            store=self.store,
            driver=LocalSandboxDriver(self.tmp / "data"),
            data_dir=self.tmp / "data",
            blobs=self.blobs,
            settings=runner_settings,
            engine=self.engine,
            wire=self.wire,
            owner=f"test-runner-{len(self.runners)}",
        )
        await runner.start()
        self.runners.append(runner)
        return runner

    async def launch(self, source: str, inputs: dict[str, Any] | None = None) -> RunDocument:
        loaded = load_workflow(source, "test.yaml")
        return await self.publisher.launch(loaded, inputs or {}, tenant="default")

    async def wait_status(self, run_id: str, *statuses: str, within: float = 20.0) -> RunDocument:
        async def probe() -> RunDocument | None:
            doc = await self.store.get_run(run_id)
            if doc.status not in statuses:
                return None
            # A settled status is written before its events and the lease release (SPEC §5.4):
            # wait for the release too, so what the test reads next is all there.
            live = doc.lease is not None and not lease_is_free(
                doc, utcnow(), self.engine.lease_timing().skew
            )
            if doc.status not in ("running", "queued") and live:
                return None
            return doc

        return await eventually(probe, within=within)

    async def queue_drained(self, within: float = 10.0) -> bool:
        """Poll until the work stream is empty: an ack follows the status write, and is
        fire-and-forget unless it is a last delivery's."""

        async def empty() -> bool:
            return await self.stream_messages() == 0

        return await eventually(empty, within=within)

    async def stream_messages(self) -> int:
        info = await self.js.stream_info(self.names.runs_stream)
        return int(info.state.messages)


@pytest.fixture
async def fleet(tmp_path: Path, nats_server: NatsServer, nats_prefix: str) -> AsyncIterator[Fleet]:
    names = WireNames(nats_prefix)
    wire = WireSettings(
        namespace=nats_prefix,
        data=tmp_path / "data",
        nats_url=nats_server.url,
        lease_ttl="3s",
        lease_skew="0.5s",
        publish_attempts=2,
        publish_retry_budget="2s",
        publish_timeout="1s",
        sweeper_grace="3s",
        sweeper_interval="1s",
        duplicate_window="30s",
    )
    engine = EngineSettings(**LEASE)  # type: ignore[arg-type]
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_streams(js, names, wire)
    dlq = DlqStore(js, names, blobs)
    publisher = Publisher(store=store, nc=nc, js=js, settings=wire, names=names, dlq=dlq)
    fleet = Fleet(tmp_path, nats_server, names, wire, engine, store, blobs, nc, js, publisher, dlq)
    try:
        yield fleet
    finally:
        for runner in fleet.runners:
            await runner.shutdown()
        await nc.close()
        await blobs.close()
        await store.close()


@pytest.fixture
async def two_deliveries(tmp_path: Path, nats_server: NatsServer) -> AsyncIterator[Fleet]:
    """A fleet whose consumer delivers a message at most twice: the second is the last."""
    from tests.runner.callables import open_fleet

    async with open_fleet(tmp_path / "two", nats_server, max_deliver=2) as fleet:
        yield fleet


@pytest.fixture
def gates(tmp_path: Path) -> Path:
    """The directory the `hold` workflows' gate files live in (`tests.runner.callables`)."""
    d = tmp_path / "gates"
    d.mkdir()
    return d
