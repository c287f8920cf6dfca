"""The scratch bank through the fleet (SPEC v2.2 §7.3-§7.5): real nats-server, runners on the
local driver over a Mongo (mongomock) store with shared file blobs — not host-backed, so every
park banks and every resume restores. Two data directories stand for two hosts."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from engine.config import EngineSettings
from engine.failures import FailureCode
from engine.loader import load_workflow_file
from engine.refusals import ScratchNotPortable
from engine.resume import ResumeRequest
from engine.sandbox.local import LocalSandboxDriver
from publisher.config import WireSettings
from publisher.dlq import DlqStore
from publisher.publisher import Publisher
from publisher.streams import ensure_streams
from publisher.wire import WireNames
from runner.config import RunnerSettings
from runner.runner import Runner
from store import Eq, RunStatus, ScratchRecord, Update
from store.blobs_fs import FilesystemBlobStore
from store.mongo import MongoRunStore
from tests.runner.conftest import LEASE, Fleet
from tests.support.nats_server import NatsServer

WORKFLOW = Path(__file__).resolve().parents[1] / "engine" / "workflows" / "scratch_bank.yaml"


class BankFleet(Fleet):
    async def runner_on(self, host: str, engine: EngineSettings | None = None) -> Runner:
        """A runner on its own "host": its own data directory, the shared store and blobs."""
        data = self.tmp / host
        runner = Runner(
            store=self.store,
            driver=LocalSandboxDriver(data),
            data_dir=data,
            blobs=self.blobs,
            settings=RunnerSettings(  # no sweeper loop: a test sweeps when it means to
                slots=2,
                http_host="127.0.0.1",
                transient_delay="0.2s",
                lagging_delay="0.2s",
                sweeper=False,
            ),
            engine=engine or self.engine,
            wire=self.wire,
            owner=f"runner-{host}",
        )
        await runner.start()
        self.runners.append(runner)
        return runner

    async def stop(self, runner: Runner) -> None:
        await runner.shutdown()
        self.runners.remove(runner)

    async def launch_bank(self, size: int = 4096) -> str:
        loaded = load_workflow_file(WORKFLOW)
        doc = await self.publisher.launch(loaded, {"size": size}, tenant="default")
        return doc.run_id


@pytest.fixture
async def bank_fleet(
    tmp_path: Path, nats_server: NatsServer, nats_prefix: str
) -> AsyncIterator[BankFleet]:
    import mongomock_motor

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
    client: Any = mongomock_motor.AsyncMongoMockClient(tz_aware=True)
    store = MongoRunStore(client[f"runfleet_bankfleet_{uuid.uuid4().hex}"])
    await store.ensure_indexes()
    blobs = FilesystemBlobStore(tmp_path / "shared-blobs")
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_streams(js, names, wire)
    dlq = DlqStore(js, names, blobs)
    publisher = Publisher(store=store, nc=nc, js=js, settings=wire, names=names, dlq=dlq)
    fleet = BankFleet(
        tmp_path, nats_server, names, wire, engine, store, blobs, nc, js, publisher, dlq
    )
    try:
        yield fleet
    finally:
        for runner in list(fleet.runners):
            await runner.shutdown()
        await nc.close()
        await blobs.close()
        await store.close()


def tree(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "->" + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_bytes() + (b"+x" if os.access(path, os.X_OK) else b"")
        else:
            out[rel] = "dir"
    return out


async def test_a_parked_run_resumed_by_another_runner_finds_its_scratch_byte_for_byte(
    bank_fleet: BankFleet,
) -> None:
    fleet = bank_fleet
    a = await fleet.runner_on("host-a")
    run_id = await fleet.launch_bank(size=300_000)
    doc = await fleet.wait_status(run_id, RunStatus.PAUSED_WAITING_HUMAN)
    assert doc.scratch is not None and doc.scratch.state == "banked"
    before = tree(fleet.tmp / "host-a" / "scratch" / run_id)
    banked = a.metrics.registry.get_sample_value("runfleet_scratch_bank_bytes_total")
    assert banked == doc.scratch.bytes
    assert a.metrics.registry.get_sample_value("runfleet_scratch_bank_seconds_count") == 1
    await fleet.stop(a)

    await fleet.runner_on("host-b")
    await fleet.publisher.resume(run_id, ResumeRequest(answers={"wipe": False}), tenant="default")
    doc = await fleet.wait_status(run_id, RunStatus.PAUSED_WAITING_HUMAN, within=30)
    assert doc.attempt == 2
    assert tree(fleet.tmp / "host-b" / "scratch" / run_id) == before
    await fleet.publisher.resume(run_id, ResumeRequest(answers={"ok": True}), tenant="default")
    doc = await fleet.wait_status(run_id, RunStatus.FINISHED, within=30)
    assert doc.checkpoint is not None and doc.checkpoint.outputs["read"] == "verified"
    assert await fleet.blobs.list(f"runs/{run_id}/scratch/") == []  # a finished run keeps none


async def test_an_unbankable_teardown_is_refused_at_the_surface_and_again_at_admission(
    bank_fleet: BankFleet,
) -> None:
    fleet = bank_fleet
    small = EngineSettings(**{**LEASE, "scratch_cap": 50_000})  # type: ignore[arg-type]
    a = await fleet.runner_on("host-a", small)
    run_id = await fleet.launch_bank(size=300_000)
    doc = await fleet.wait_status(run_id, RunStatus.PAUSED_WAITING_HUMAN)
    assert doc.scratch is not None and doc.scratch.state == "unbankable"
    with pytest.raises(ScratchNotPortable):
        await fleet.publisher.resume(
            run_id, ResumeRequest(answers={"wipe": False}), tenant="default"
        )
    with pytest.raises(ScratchNotPortable):  # --force alone never accepts the loss (§7.5)
        await fleet.publisher.resume(
            run_id, ResumeRequest(answers={"wipe": False}, force=True), tenant="default"
        )
    await fleet.stop(a)

    # A resume queued while the record still named a good bank; the record that lands after it
    # says the teardown could not bank: admission (step 7) refuses it again.
    doc = await fleet.store.update_run(
        run_id,
        [],
        Update(set={"scratch": ScratchRecord(state="banked", key="x", progress=1).model_dump()}),
    )
    queued = await fleet.publisher.resume(
        run_id, ResumeRequest(answers={"wipe": False}), tenant="default"
    )
    assert queued.status is RunStatus.QUEUED
    await fleet.store.update_run(
        run_id,
        [Eq("status", RunStatus.QUEUED)],
        Update(set={"scratch": ScratchRecord(state="unbankable", bytes=9).model_dump()}),
    )
    await fleet.runner_on("host-b")
    doc = await fleet.wait_status(run_id, RunStatus.PAUSED_WAITING_HUMAN, within=30)
    assert doc.failure_code == FailureCode.SCRATCH_NOT_PORTABLE
    assert doc.checkpoint is not None and "act" not in doc.checkpoint.completed

    # --accept-scratch-loss passes; the claim writes `forsaken`, nothing is restored or refused.
    await fleet.publisher.resume(
        run_id, ResumeRequest(answers={"wipe": False}, accept_scratch_loss=True), tenant="default"
    )
    doc = await fleet.wait_status(run_id, RunStatus.PAUSED_WAITING_HUMAN, within=30)
    assert doc.checkpoint is not None and "act" in doc.checkpoint.completed
    events = await fleet.store.read_events(run_id, 0, 10_000)
    [restored] = [e for e in events if e.type == "sandbox_scratch_restored"]
    assert restored.data["accepted"] and not restored.data["restored"]


def test_admission_refuses_a_bank_a_sandbox_node_moved_past_unless_a_rewind_dropped_it() -> None:
    from datetime import timedelta

    from publisher.wire import RunMessage
    from runner.admission import AdmissionTiming, Claim, Refuse, judge
    from runner.deliveries import DeliveryInfo
    from store import Checkpoint, utcnow
    from tests.runner.callables import new_run

    now = utcnow()
    timing = AdmissionTiming(
        skew=timedelta(seconds=0.5),
        lease_interval=timedelta(seconds=1),
        busy_last=timedelta(seconds=25),
        lagging_delay=timedelta(seconds=2),
    )
    bank = ScratchRecord(state="banked", key="k", progress=2)
    message = RunMessage(run_id="r1", tenant="default", attempt=2, kind="resume", published_at=now)
    delivery = DeliveryInfo(stream_seq=1, num_delivered=1, max_deliver=10)

    def decide(cp: Checkpoint) -> object:
        doc = new_run(
            "hello", run_id="r1", status=RunStatus.RUNNING, attempt=2, scratch=bank, checkpoint=cp
        )
        return judge(message, doc, delivery, now, timing)

    # `t` (a tool node) finished at progress 3, after the bank at 2: refused.
    moved = Checkpoint(restart_node="c", progress=4, completed=["t", "c"], sandbox_done={"t": 3})
    refused = decide(moved)
    assert isinstance(refused, Refuse) and refused.kind == "scratch"
    # A rewind dropped `t` (no longer completed): the bank is acceptable again.
    rewound = moved.model_copy(update={"completed": [], "restart_node": "t"})
    assert decide(rewound) == Claim("adoption")
    # Engine-side nodes never count: only sandbox nodes are in `sandbox_done`.
    compute_only = Checkpoint(
        restart_node="c", progress=5, completed=["t", "c"], sandbox_done={"t": 2}
    )
    assert decide(compute_only) == Claim("adoption")


async def test_the_sweeper_deletes_bank_keys_no_record_names_for_runs_with_no_live_lease(
    bank_fleet: BankFleet,
) -> None:
    from datetime import timedelta

    from runner.sweeper import Sweeper
    from store import Lease, utcnow

    fleet = bank_fleet
    a = await fleet.runner_on("host-a")
    run_id = await fleet.launch_bank()
    doc = await fleet.wait_status(run_id, RunStatus.PAUSED_WAITING_HUMAN)
    assert doc.scratch is not None and doc.scratch.key is not None
    named = doc.scratch.key
    orphan = f"runs/{run_id}/scratch/died-before-its-record.tgz"
    gone = "runs/no-such-run/scratch/t.tgz"
    for key in (orphan, gone):
        await fleet.blobs.put_bytes(key, b"x")
    assert a.svc is not None
    report = await Sweeper(a.svc).sweep_once(force=True)
    assert report.actions["scratch_bank_reaped"] == 2
    left = sorted(i.key for i in await fleet.blobs.list("runs/"))
    assert named in left and orphan not in left and gone not in left
    # A run whose lease is live banks and sweeps for itself: its keys are left alone.
    live = Lease(owner="x", token="t", attempt=1, expires_at=utcnow() + timedelta(minutes=1))
    await fleet.store.update_run(run_id, [], Update(set={"lease": live.model_dump()}))
    await fleet.blobs.put_bytes(orphan, b"x")
    report = await Sweeper(a.svc).sweep_once(force=True)
    assert report.actions["scratch_bank_reaped"] == 0
    assert await fleet.blobs.stat(orphan) is not None
