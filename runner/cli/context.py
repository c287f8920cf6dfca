"""Opening what a command needs, from `RUNFLEET_*` settings (SPEC §12), and closing it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineSettings
from engine.sandbox.local import LocalSandboxDriver
from engine.sandbox.protocols import SandboxDriver
from store import BlobStore, RunfleetError, RunStore
from store.blob_url import open_blob_store
from store.config import StoreSettings
from store.url import open_store


class UnknownSandboxDriver(RunfleetError):
    code = "unknown_sandbox_driver"
    remedy = "set RUNFLEET_SANDBOX=local (the only driver in this build)"


@dataclass
class Env:
    settings: StoreSettings
    engine: EngineSettings
    store: RunStore
    blobs: BlobStore

    @property
    def data_dir(self) -> Path:
        return self.settings.data.resolve()

    def driver(self) -> SandboxDriver:
        if self.engine.sandbox != "local":
            raise UnknownSandboxDriver(f"no sandbox driver {self.engine.sandbox!r}")
        return LocalSandboxDriver(self.data_dir)


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
