"""Call-node functions for the runner tests (`tests.runner.callables:<name>`), and the small
helpers the rule tests use to craft runs and deliveries precisely.

The callables keep their state in files under the run's `dir` input (one file per run id), so a
test can wait on them and count attempts without sharing Python objects with a runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from nats.js.api import PubAck

from engine.call_errors import Permanent, Transient
from engine.loader import LoadedWorkflow, load_workflow
from engine.nodes import CallContext
from publisher.wire import HDR_ATTEMPT, HDR_MSG_ID, HDR_SCHEMA, msg_id
from store import (
    CasConflict,
    Checkpoint,
    Eq,
    Lease,
    Origin,
    RunDocument,
    RunStatus,
    RunStore,
    Update,
    WorkflowRef,
    utcnow,
)

# -- call nodes ---------------------------------------------------------------------------------


def _record(path: Path, line: str) -> int:
    with path.open("a") as f:
        f.write(line + "\n")
    return len(path.read_text().splitlines())


async def hold(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Appends the attempt to `<dir>/<run_id>.entered`, then waits until the test creates
    `<dir>/<run_id>.release`."""
    d = Path(inputs["dir"])
    await asyncio.to_thread(_record, d / f"{ctx.run_id}.entered", str(ctx.attempt))
    release = d / f"{ctx.run_id}.release"
    while True:
        if await asyncio.to_thread(release.exists):
            return {"released": True}
        await asyncio.sleep(0.02)


async def fail_first(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Appends the attempt to `<dir>/<run_id>.calls`; raises `code` (transient, or permanent
    when `permanent` is "true") for the first `failures` calls of the run (-1: always)."""
    d = Path(inputs["dir"])
    n = await asyncio.to_thread(_record, d / f"{ctx.run_id}.calls", str(ctx.attempt))
    failures = int(inputs.get("failures", -1))
    if failures < 0 or n <= failures:
        if str(inputs.get("permanent", "false")) == "true":
            raise Permanent(str(inputs["code"]), f"call {n}: never")
        raise Transient(str(inputs["code"]), f"call {n}: try again")
    return {"calls": n}


def entered(d: Path, run_id: str) -> list[int]:
    """The attempts that entered `hold` for the run."""
    path = d / f"{run_id}.entered"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def calls(d: Path, run_id: str) -> list[int]:
    """The attempts that called `fail_first` for the run."""
    path = d / f"{run_id}.calls"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def release(d: Path, run_id: str) -> None:
    (d / f"{run_id}.release").touch()


# -- crafting runs and deliveries ---------------------------------------------------------------

WORKFLOWS = Path(__file__).parent / "workflows"


def workflow(name: str) -> LoadedWorkflow:
    """`tests/runner/workflows/<name>.yaml`, loaded."""
    return load_workflow((WORKFLOWS / f"{name}.yaml").read_text(), f"{name}.yaml")


def new_run(
    name: str,
    *,
    run_id: str,
    status: RunStatus,
    attempt: int = 1,
    inputs: dict[str, Any] | None = None,
    **fields: Any,
) -> RunDocument:
    """A run document as a test wants it (any status, attempt, lease, checkpoint...)."""
    loaded = workflow(name)
    now = utcnow()
    doc: dict[str, Any] = {
        "run_id": run_id,
        "tenant": "default",
        "origin": Origin.FLEET,
        "workflow": WorkflowRef(
            name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
        ),
        "inputs": inputs or {},
        "budget": loaded.workflow.budget.to_store(),
        "status": status,
        "attempt": attempt,
        "attempt_at": now,
        "created_at": now,
        "updated_at": now,
        **fields,
    }
    return RunDocument.model_validate(doc)


def lease(
    attempt: int, *, stream_seq: int | None = None, owner: str = "ghost", ttl: float = 3.0
) -> Lease:
    return Lease(
        owner=owner,
        token=f"{owner}-token",
        attempt=attempt,
        stream_seq=stream_seq,
        expires_at=utcnow() + timedelta(seconds=ttl),
    )


def body(
    run_id: str,
    attempt: int,
    *,
    tenant: str = "default",
    kind: str = "launch",
    published_at: datetime | None = None,
    **extra: Any,
) -> bytes:
    return json.dumps(
        {
            "v": 1,
            "run_id": run_id,
            "tenant": tenant,
            "attempt": attempt,
            "kind": kind,
            "published_at": (published_at or utcnow()).isoformat(),
            **extra,
        }
    ).encode()


async def publish_raw(
    js: Any,
    subject: str,
    data: bytes,
    *,
    run_id: str | None = None,
    attempt: int | None = None,
    id_: str | None = None,
) -> PubAck:
    """Publish a work message by hand (headers as the publisher writes them when the run id
    and attempt are given; `id_` overrides `Nats-Msg-Id`)."""
    headers: dict[str, str] = {HDR_SCHEMA: "1"}
    if run_id is not None and attempt is not None:
        headers[HDR_MSG_ID] = msg_id(run_id, attempt)
        headers[HDR_ATTEMPT] = str(attempt)
    if id_ is not None:
        headers[HDR_MSG_ID] = id_
    ack: PubAck = await js.publish(subject, data, headers=headers)
    return ack


@contextlib.asynccontextmanager
async def ghost_owner(store: RunStore, run_id: str, token: str) -> AsyncIterator[None]:
    """An execution the test plays: keeps refreshing the lease with `token` (every 0.3 s, TTL
    3 s) until the block ends; then the lease lapses like a crashed owner's."""
    stop = asyncio.Event()

    async def refresh() -> None:
        while not stop.is_set():
            result = await store.update_run(
                run_id,
                [Eq("lease.token", token)],
                Update(
                    set={"lease.expires_at": utcnow() + timedelta(seconds=3)}, bump_version=False
                ),
            )
            if isinstance(result, CasConflict):
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.3)

    task = asyncio.ensure_future(refresh())
    try:
        yield
    finally:
        stop.set()
        await task


def sample(registry: Any, name: str, **labels: str) -> float:
    """A metric's current value (0 when never set)."""
    value = registry.get_sample_value(name, labels)
    return float(value) if value is not None else 0.0


def bound_drain(runners: Any) -> None:
    """Bound each runner's `nc.drain()` to 2 s before the fleet shuts it down.

    Works around a runner bug (reported): `Runner.shutdown` unsubscribes only the backstop's
    pull subscription before `nc.drain()`, not the fetch loop's; nats-py's `fetch` takes
    leftover status messages off the queue without `task_done()`, so that subscription's drain
    waits out the whole drain timeout (30 s) after any test that idled a few fetch cycles."""
    for runner in runners:
        if runner.svc is not None:
            runner.svc.nc.options["drain_timeout"] = 2


@contextlib.asynccontextmanager
async def open_fleet(tmp: Path, server: Any, **wire: Any) -> AsyncIterator[Any]:
    """A fleet like the `fleet` fixture's, on its own namespace, with other wire settings
    (e.g. a small `max_deliver`)."""
    import uuid

    import nats

    from engine.config import EngineSettings
    from publisher import DlqStore, Publisher, WireNames, WireSettings, ensure_streams
    from store.blobs_fs import FilesystemBlobStore
    from store.sqlite import SqliteRunStore
    from tests.runner.conftest import LEASE, Fleet

    prefix = f"t{uuid.uuid4().hex[:16]}"
    names = WireNames(prefix)
    settings = WireSettings(
        **{
            "namespace": prefix,
            "data": tmp / "data",
            "nats_url": server.url,
            "lease_ttl": "3s",
            "lease_skew": "0.5s",
            "publish_attempts": 2,
            "publish_retry_budget": "2s",
            "publish_timeout": "1s",
            "sweeper_grace": "3s",
            "sweeper_interval": "1s",
            "duplicate_window": "30s",
            **wire,
        }
    )
    engine = EngineSettings(**LEASE)  # type: ignore[arg-type]
    store = await SqliteRunStore.open(tmp / "runs.db")
    blobs = FilesystemBlobStore(tmp / "blobs")
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    await ensure_streams(js, names, settings)
    dlq = DlqStore(js, names, blobs)
    publisher = Publisher(store=store, nc=nc, js=js, settings=settings, names=names, dlq=dlq)
    fleet = Fleet(tmp, server, names, settings, engine, store, blobs, nc, js, publisher, dlq)
    try:
        yield fleet
    finally:
        bound_drain(fleet.runners)
        for runner in fleet.runners:
            await runner.shutdown()
        await nc.close()
        await blobs.close()
        await store.close()


async def idle_runner(fleet: Any, owner: str = "idle", **settings: Any) -> Any:
    """A started runner that does not consume the work queue (its sweeper and backstop are
    driven by hand): `runner.svc` is what `Sweeper` and `Backstop` take."""
    from engine.sandbox.local import LocalSandboxDriver
    from runner.config import RunnerSettings
    from runner.runner import Runner

    runner = Runner(
        store=fleet.store,
        driver=LocalSandboxDriver(fleet.tmp / "data"),
        data_dir=fleet.tmp / "data",
        blobs=fleet.blobs,
        settings=RunnerSettings(
            **{
                "slots": 1,
                "http_host": "127.0.0.1",
                "sweeper": False,
                "backstop": False,
                **settings,
            }
        ),
        engine=fleet.engine,
        wire=fleet.wire,
        owner=owner,
        consume=False,
    )
    await runner.start()
    fleet.runners.append(runner)
    return runner


def failed_at_hold(run_id: str, gates: Path, code: str, **fields: Any) -> RunDocument:
    """`hold.yaml` parked `failed_resumable` at its `hold` node by an earlier execution
    (`fields`: more of the document, e.g. its `scratch`)."""
    return new_run(
        "hold",
        run_id=run_id,
        status=RunStatus.FAILED_RESUMABLE,
        failure_code=code,
        error=f"{code}: the earlier execution's failure",
        inputs={"dir": str(gates)},
        checkpoint=Checkpoint(
            restart_node="hold",
            outputs={"before": {"ready": "yes"}},
            completed=["before"],
            progress=1,
            vars={"dir": str(gates)},
        ),
        **fields,
    )
