"""The API served from its own thread and event loop, over its own SQLite store and the
session's nats-server: for clients that block (schemathesis calls with `requests`), which
would stall a server sharing their loop. Seeded with one run of tenant `default` and a DLQ
record of it, so a fuzzer with tenant `b`'s token has something it must never see.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import nats
from aiohttp import web

from engine.config import EngineSettings
from publisher import DlqStore, WireNames, WireSettings, ensure_streams
from runner.console import create_app
from runner.operations import Env
from store import RunStatus
from store.blobs_fs import FilesystemBlobStore
from store.config import StoreSettings
from store.sqlite import SqliteRunStore
from tests.console.conftest import TOKENS
from tests.publisher.conftest import delete_streams, put_run
from tests.runner.conftest import LEASE


@dataclass(frozen=True)
class Seeded:
    url: str
    run_id: str
    record_id: int


class ServedApi:
    def __init__(self, nats_url: str, tmp: Path) -> None:
        self.nats_url = nats_url
        self.tmp = tmp
        self.names = WireNames(f"api{uuid.uuid4().hex[:10]}")
        self._ready: Future[Seeded] = Future()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="served-api", daemon=True)

    def start(self, timeout: float = 30.0) -> Seeded:
        self._thread.start()
        return self._ready.result(timeout)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting test
            if not self._ready.done():
                self._ready.set_exception(exc)
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        wire = WireSettings(
            namespace=self.names.namespace,
            data=self.tmp / "data",
            nats_url=self.nats_url,
            publish_attempts=2,
            publish_retry_budget="2s",
            publish_timeout="1s",
        )
        store = await SqliteRunStore.open(self.tmp / "runs.db")
        blobs = FilesystemBlobStore(self.tmp / "blobs")
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()
        try:
            await ensure_streams(js, self.names, wire)
            settings = StoreSettings(data=self.tmp / "data", tenant="default")
            engine = EngineSettings(**LEASE)  # type: ignore[arg-type]
            env = Env(settings, engine, store, blobs, "runfleet-api-fuzz", wire)
            # settled, so a followed stream of it ends, and no fuzzed resume or cancel moves it
            run = await put_run(store, status=RunStatus.FINISHED)
            record = await DlqStore(js, self.names, blobs).put(
                seq=7, body=b"{}", headers={}, reason="max_deliveries", run_id=run.run_id
            )
            runner = web.AppRunner(create_app(env, TOKENS), access_log=None, shutdown_timeout=2)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self._ready.set_result(Seeded(f"http://{host}:{port}", run.run_id, record.id))
            await self._stop.wait()
            await runner.cleanup()
        finally:
            await delete_streams(js, self.names)
            await nc.close()
            await blobs.close()
            await store.close()
