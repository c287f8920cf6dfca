"""Opening what a command needs, from `RUNFLEET_*` settings (SPEC §12), and closing it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineSettings
from engine.sandbox.protocols import SandboxDriver
from engine.sandbox.registry import DriverContext, open_driver
from publisher import DlqStore, Publisher, WireNames, WireSettings, connect
from store import BlobStore, RunStore
from store.blob_url import open_blob_store
from store.config import StoreSettings
from store.url import open_store


@dataclass
class Env:
    settings: StoreSettings
    engine: EngineSettings
    store: RunStore
    blobs: BlobStore

    @property
    def data_dir(self) -> Path:
        return self.settings.data.resolve()

    @contextlib.asynccontextmanager
    async def publisher(self) -> AsyncIterator[Publisher]:
        """A connected publisher (NATS errors become `NatsUnavailable`, exit code 4)."""
        wire = WireSettings(data=self.settings.data)
        nc, js = await connect(wire, name="runfleet-cli")
        try:
            names = WireNames(wire.namespace)
            yield Publisher(
                store=self.store,
                nc=nc,
                js=js,
                settings=wire,
                names=names,
                dlq=DlqStore(js, names, self.blobs),
            )
        finally:
            await nc.close()

    def driver(self) -> SandboxDriver:
        """`RUNFLEET_SANDBOX`'s driver; `UnknownSandboxDriver` (naming the known) otherwise."""
        return open_driver(self.engine.sandbox, DriverContext(data_dir=self.data_dir))


@contextlib.asynccontextmanager
async def open_env(data: Path | None = None) -> AsyncIterator[Env]:
    settings = StoreSettings() if data is None else StoreSettings(data=data)
    engine = EngineSettings()
    store = await open_store(settings.effective_store_url)
    try:
        blobs = open_blob_store(settings.effective_blob_url)
        try:
            yield Env(settings, engine, store, blobs)
        finally:
            await blobs.close()
    finally:
        await store.close()
