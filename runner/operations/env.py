"""What an operation runs against, opened from `RUNFLEET_*` settings (SPEC §12), and closed.

One `Env` per process (the CLI opens one per command; a console or an HTTP API keeps one for
its life): the run store, the blob store and the settings. NATS is connected per operation that
needs it (`Env.publisher()`), and its errors are translated there, at the one boundary, so an
operation raises nothing but `RunfleetError`s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineSettings
from publisher.config import NatsSettings, WireSettings
from store import BlobStore, Event, InvalidStoreUrl, RunStore
from store.blob_url import open_blob_store
from store.config import StoreSettings
from store.settings import SettingProblem, SettingsInvalid
from store.url import open_store, redact

if TYPE_CHECKING:
    from engine.local import LocalEnv
    from engine.sandbox.protocols import SandboxDriver
    from publisher.dlq import DlqStore
    from publisher.publisher import Publisher

# NATS, the publisher and the engine's execution are imported where they are used: a command
# that only reads the store (`runs`, `status`, `events`) starts without them (ADR-0024).


@dataclass
class Env:
    settings: StoreSettings
    engine_settings: EngineSettings | None
    """The engine settings, when the caller has them; else read from `RUNFLEET_*` on first
    use (`Env.engine`), so a command that never executes, rewinds or sweeps (`runs`, `status`,
    `events`, `dlq list`) does not trip on a lease or sandbox setting it does not use."""
    store: RunStore
    blobs: BlobStore
    client: str = "runfleet-cli"
    """The NATS connection name (what `nats-server`'s connection list shows)."""
    wire_settings: WireSettings | None = None
    """The wire settings, when the caller has them; else read from `RUNFLEET_*`."""
    store_made: bool = False
    """A command that only reads made the embedded default's store just now: nothing ran with
    this `RUNFLEET_DATA` before, which is most often a command run from the wrong directory
    (found by a newcomer's walkthrough: `runs` answered an empty table, and nothing said why)."""

    @property
    def engine(self) -> EngineSettings:
        if self.engine_settings is None:
            self.engine_settings = EngineSettings()
        return self.engine_settings

    @property
    def data_dir(self) -> Path:
        return self.settings.data.resolve()

    @property
    def tenant(self) -> str:
        """`RUNFLEET_TENANT`: the tenant an operation acts for unless told another."""
        return self.settings.tenant

    def wire(self) -> WireSettings:
        if self.wire_settings is not None:
            return self.wire_settings
        return WireSettings(data=self.settings.data)

    def nats(self) -> NatsSettings:
        """Where NATS is (a subset of the wire settings): what reading the DLQ needs."""
        if self.wire_settings is not None:
            return self.wire_settings
        return NatsSettings(data=self.settings.data)

    @contextlib.asynccontextmanager
    async def dlq(self) -> AsyncIterator[DlqStore]:
        """The DLQ records, to list, show or remove: reads only `NatsSettings`, so a bad lease
        or publish setting does not stop `dlq list` (SPEC §10 v2.2). Errors as `publisher`."""
        from publisher.connection import connect
        from publisher.dlq import DlqStore
        from publisher.nats_errors import nats_boundary
        from publisher.wire import WireNames

        nats = self.nats()
        nc, js = await connect(nats, name=self.client)
        try:
            with nats_boundary():
                yield DlqStore(js, WireNames(nats.namespace), self.blobs)
        finally:
            await nc.close()

    @contextlib.asynccontextmanager
    async def publisher(self) -> AsyncIterator[Publisher]:
        """A connected publisher. An unreachable server is `NatsUnavailable` (exit code 4);
        any NATS error raised in the block leaves it translated (`publisher.nats_errors`)."""
        from publisher.connection import connect
        from publisher.dlq import DlqStore
        from publisher.nats_errors import nats_boundary
        from publisher.publisher import Publisher
        from publisher.wire import WireNames

        wire = self.wire()
        nc, js = await connect(wire, name=self.client)
        try:
            names = WireNames(wire.namespace)
            publisher = Publisher(
                store=self.store,
                nc=nc,
                js=js,
                settings=wire,
                names=names,
                dlq=DlqStore(js, names, self.blobs),
            )
            try:
                with nats_boundary():
                    yield publisher
            finally:
                await publisher.flush()  # the launches' publication records, before the store
        finally:
            await nc.close()

    def driver(self) -> SandboxDriver:
        """`RUNFLEET_SANDBOX`'s driver, and any a workflow names (SPEC §6.1: the file wins);
        `UnknownSandboxDriver` (naming the known) for an unknown name."""
        from engine.sandbox.registry import DriverContext
        from engine.sandbox.router import DriverRouter

        return DriverRouter(self.engine.sandbox, DriverContext(data_dir=self.data_dir))

    def local(self, on_event: Callable[[Event], None] | None = None) -> LocalEnv:
        """What an in-process execution needs (`run`, `resume --local`)."""
        from engine.local import LocalEnv

        return LocalEnv(
            self.store, self.driver(), self.engine, self.data_dir, self.blobs, on_event=on_event
        )


@contextlib.contextmanager
def _setting(*names: str, value: str | None = None) -> Iterator[None]:
    """A store URL that names no backend runfleet can open is a bad setting (exit 2), named
    as the user typed it (with its `value` when one variable was set), not an internal error."""
    try:
        yield
    except InvalidStoreUrl as exc:
        message = f"{' / '.join(names)}: {exc.message}"
        if value is not None:
            shown = redact(value)
            message = f"{names[0]}={shown}: {exc.message.removeprefix(f'{shown}: ')}"
        problem = SettingProblem(names, message, exc.remedy or "fix the URL")
        raise SettingsInvalid([problem]) from exc


@contextlib.asynccontextmanager
async def open_env(
    data: Path | None = None, *, client: str = "runfleet-cli", create_store: bool = True
) -> AsyncIterator[Env]:
    """`create_store=False` is for a command that only reads, or acts on runs already there
    (resume, cancel, rewind, sweep, gc, dlq replay/purge): an explicit `RUNFLEET_STORE_URL`
    naming a SQLite file that does not exist is then a usage error, not a new empty store that
    answers "no runs" and hides a typo. An explicit URL's directory is never created; the
    embedded default under `RUNFLEET_DATA` is, by every command, so a fresh machine's first
    command works."""
    settings = StoreSettings() if data is None else StoreSettings(data=data)
    explicit = settings.store_url
    made = explicit is None and not create_store and not (settings.data / "runs.db").exists()
    with _setting("RUNFLEET_STORE_URL", value=explicit):
        store = await open_store(
            settings.effective_store_url,
            create=create_store or explicit is None,
            parents=explicit is None,
        )
    try:
        with _setting("RUNFLEET_BLOB_URL", "RUNFLEET_S3_ENDPOINT", "RUNFLEET_S3_REGION"):
            blobs = open_blob_store(settings.effective_blob_url)
        try:
            yield Env(settings, None, store, blobs, client, store_made=made)
        finally:
            await blobs.close()
    finally:
        await store.close()
