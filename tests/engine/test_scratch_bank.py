"""The scratch bank and its restore (SPEC v2.2 §7.2b-§7.5), on the local driver with a Mongo
(mongomock) store, so the deployment is not host-backed and the bank is real: file blobs stand
for the shared object store, and two data directories for two hosts."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from engine.archive import ArchiveStats, make_archive
from engine.config import EngineSettings
from engine.events import EventLog
from engine.execution import Execution
from engine.failures import FailureCode
from engine.loader import load_workflow_file
from engine.local import LocalEnv, claim_local, resume_local, run_local
from engine.outcome import CancelReason, Interrupted, Paused
from engine.refusals import ScratchNotPortable
from engine.resume import ResumeRequest, scratch_problem
from engine.rewind import rewind
from engine.sandbox.local import LocalSandboxDriver
from engine.scratch import bank_prefix, deployment_host_backed, host_backed_of
from engine.settle import settle
from store import (
    BlobInfo,
    Event,
    RunDocument,
    RunStatus,
    RunStore,
    ScratchRecord,
    StoreUnavailable,
    Update,
)
from store.blobs_fs import FilesystemBlobStore
from store.mongo import MongoRunStore
from store.sqlite import SqliteRunStore
from tests.engine.bank_doubles import Records, Said
from tests.engine.conftest import workflow

WIPE = {"wipe": True}
KEEP = {"wipe": False}


class FlakyBlobs(FilesystemBlobStore):
    """The shared blob store, with faults a test arms: uploads or reads that fail."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.put_failures = 0
        self.puts = 0
        self.get_fails = False

    async def put_file(self, key: str, path: Path) -> BlobInfo:
        self.puts += 1
        if self.put_failures > 0:
            self.put_failures -= 1
            raise StoreUnavailable("object store unreachable (test fault)")
        return await super().put_file(key, path)

    async def get_to_file(self, key: str, path: Path) -> BlobInfo:
        if self.get_fails:
            await asyncio.to_thread(path.write_bytes, b"\x1f\x8b partial")
            raise StoreUnavailable("connection reset mid-read (test fault)")
        return await super().get_to_file(key, path)


@pytest.fixture
async def mongo() -> AsyncIterator[RunStore]:
    import mongomock_motor

    client: Any = mongomock_motor.AsyncMongoMockClient(tz_aware=True)
    store = MongoRunStore(client[f"runfleet_bank_{uuid.uuid4().hex}"])
    await store.ensure_indexes()
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def blobs(tmp_path: Path) -> FlakyBlobs:
    return FlakyBlobs(tmp_path / "shared-blobs")


def host(
    store: RunStore, blobs: FlakyBlobs, data: Path, settings: EngineSettings | None = None
) -> LocalEnv:
    return LocalEnv(
        store=store,
        driver=LocalSandboxDriver(data),
        settings=settings or EngineSettings(),
        data_dir=data,
        blobs=blobs,
    )


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


async def events_of(store: RunStore, run_id: str, kind: str) -> list[Event]:
    return [e for e in await store.read_events(run_id, 0, 10_000) if e.type == kind]


async def keys(blobs: FlakyBlobs, run_id: str) -> list[str]:
    return sorted(i.key for i in await blobs.list(bank_prefix(run_id)))


def marked(after: ScratchRecord | None, bank: ScratchRecord | None, token: str = "") -> bool:
    """`after` is the mark a later execution (`token`) wrote over `bank` before its first tool
    node: `unknown`, still naming the bank's key and progress (adr/0011, amendment)."""
    assert after is not None and bank is not None
    same = (after.key, after.bytes, after.progress) == (bank.key, bank.bytes, bank.progress)
    by = after.lease_token == token if token else after.lease_token != bank.lease_token
    return after.state == "unknown" and by and same


async def parked(env: LocalEnv, size: int = 4096) -> RunDocument:
    doc = await run_local(env, workflow("scratch_bank"), {"size": size})
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN, doc
    return doc


def test_host_backed_is_the_local_driver_on_sqlite_with_file_blobs_only() -> None:
    assert deployment_host_backed("local", "sqlite:////d/runs.db", "file:///d/blobs")
    assert deployment_host_backed("local", "sqlite:////d/runs.db", None)
    assert not deployment_host_backed("local", "mongodb://m/db", "file:///d/blobs")
    assert not deployment_host_backed("local", "sqlite:////d/runs.db", "s3://bucket/p")
    assert not deployment_host_backed("kubernetes", "sqlite:////d/runs.db", "file:///d/b")


async def test_host_backed_is_decided_from_the_opened_store_and_blobs(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    assert not host_backed_of("local", mongo, blobs)
    sqlite = await SqliteRunStore.open(tmp_path / "runs.db")
    try:
        assert host_backed_of("local", sqlite, blobs)
        assert not host_backed_of("kubernetes", sqlite, blobs)
    finally:
        await sqlite.close()


async def test_a_parked_run_resumed_on_another_host_finds_its_scratch_byte_for_byte(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a, size=200_000)
    rec = doc.scratch
    assert rec is not None and rec.state == "banked" and rec.key is not None
    assert rec.key == f"runs/{doc.run_id}/scratch/{rec.lease_token}.tgz"
    assert await keys(blobs, doc.run_id) == [rec.key]
    [banked] = await events_of(mongo, doc.run_id, "sandbox_scratch_banked")
    assert banked.data["banked"] and banked.data["bytes"] == rec.bytes > 0
    assert banked.data["unquiesced"] is False and banked.data["raced"] == []
    before = tree(tmp_path / "a" / "scratch" / doc.run_id)
    assert "sub/data.bin" in before and before["link"] == "->sub/data.bin"

    doc = await resume_local(b, doc.run_id, ResumeRequest(answers=KEEP))
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN
    assert tree(tmp_path / "b" / "scratch" / doc.run_id) == before
    [restored] = await events_of(mongo, doc.run_id, "sandbox_scratch_restored")
    assert restored.data["restored"] and restored.data["bytes"] == 200_000 + 24
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers={"ok": True}))
    assert doc.status is RunStatus.FINISHED
    assert doc.checkpoint is not None and doc.checkpoint.outputs["read"] == "verified"


async def test_a_finished_run_keeps_no_bank(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP))
    assert await keys(blobs, doc.run_id)
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers={"ok": True}))
    assert doc.status is RunStatus.FINISHED
    assert await keys(blobs, doc.run_id) == []


async def test_an_empty_scratch_deletes_the_previous_bank(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    assert len(await keys(blobs, doc.run_id)) == 1
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers=WIPE))
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN
    assert doc.scratch is not None and doc.scratch.state == "empty" and doc.scratch.key is None
    assert await keys(blobs, doc.run_id) == []
    last = (await events_of(mongo, doc.run_id, "sandbox_scratch_banked"))[-1]
    assert last.data["empty"] and not last.data["banked"]


async def test_over_the_cap_is_not_stored_and_the_event_says_why_then_a_resume_is_refused(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a = host(mongo, blobs, tmp_path / "a", EngineSettings(scratch_cap=50_000))
    doc = await parked(a, size=300_000)
    assert doc.scratch is not None and doc.scratch.state == "unbankable"
    assert await keys(blobs, doc.run_id) == [] and blobs.puts == 0
    [banked] = await events_of(mongo, doc.run_id, "sandbox_scratch_banked")
    assert not banked.data["banked"] and "cap" in banked.data["reason"]
    # §7.4: the last teardown recorded a non-empty scratch it could not bank.
    assert scratch_problem(doc) is not None
    with pytest.raises(ScratchNotPortable):
        await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP))
    with pytest.raises(ScratchNotPortable):  # --force alone never accepts a scratch loss (§7.5)
        await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP, force=True))
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP, accept_scratch_loss=True))
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN
    [restored] = await events_of(mongo, doc.run_id, "sandbox_scratch_restored")
    assert restored.data["accepted"] and not restored.data["restored"]
    # the accepted loss started a fresh scratch; this teardown's new record clears `forsaken`
    assert doc.scratch is not None and doc.scratch.state == "empty"
    assert not doc.scratch.forsaken


async def test_a_lost_lease_banks_nothing(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    held = doc.scratch
    claimed = await claim_local(a, doc, ResumeRequest(answers=KEEP))
    assert claimed.lease is not None
    events = EventLog(mongo, claimed.run_id, claimed.attempt, claimed.lease.token)
    execution = Execution.claimed(a, claimed, events.__class__ and _cancel(), events)
    sandbox = await execution.ensure_sandbox()
    await sandbox.exec('echo changed > "$RUNFLEET_SCRATCH_DIR/new"', timeout_s=10)
    execution.cancel.cancel(CancelReason.LEASE_LOST)
    await execution.teardown(Interrupted(CancelReason.LEASE_LOST))
    after = await mongo.get_run(doc.run_id)
    assert after.scratch == held
    assert await keys(blobs, doc.run_id) == [held.key if held else ""]


def _cancel() -> Any:
    from engine.cancel import CancelSignal

    return CancelSignal()


async def test_a_file_rewritten_during_the_tar_is_reread_and_the_bank_holds_one_version(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.archive
    import engine.scratch

    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    busy = tmp_path / "a" / "scratch" / doc.run_id / "busy.bin"
    tars: list[ArchiveStats] = []
    real_read = engine.archive._read

    def read_while_rewritten(fd: int, n: int) -> bytes:
        if not tars and not getattr(read_while_rewritten, "done", False):
            read_while_rewritten.done = True  # type: ignore[attr-defined]
            busy.write_bytes(b"\2" * (5 << 20))  # the writer rewrites it under the tar
        return real_read(fd, n)

    def tar_and_note(src: Path, dest: Path, **kw: Any) -> ArchiveStats:
        stats = make_archive(src, dest, **kw)
        tars.append(stats)
        return stats

    monkeypatch.setattr(engine.archive, "_read", read_while_rewritten)
    monkeypatch.setattr(engine.scratch, "make_archive", tar_and_note)
    claimed = await claim_local(a, doc, ResumeRequest(answers=KEEP))
    assert claimed.lease is not None
    # the restore empties the scratch and extracts the bank: put the busy file back after it
    events = EventLog(mongo, claimed.run_id, claimed.attempt, claimed.lease.token)
    execution = Execution.claimed(a, claimed, _cancel(), events)
    outcome = await execution.run()
    assert isinstance(outcome, Paused)
    await settle(execution.writer, events, outcome)
    busy.write_bytes(b"\1" * (3 << 20))
    await execution.teardown(outcome)
    assert [t.raced for t in tars] == [["busy.bin"], []]
    rec = (await mongo.get_run(doc.run_id)).scratch
    assert rec is not None and rec.state == "banked" and rec.raced == [] and rec.key
    data = await blobs.get_bytes(rec.key)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile("busy.bin")
        assert member is not None
        content = member.read()
    assert content == b"\2" * (5 << 20)  # one version, not a mix


async def test_an_upload_failing_twice_then_succeeding_banks_once(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    blobs.put_failures = 2
    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    assert blobs.puts == 3
    assert doc.scratch is not None and doc.scratch.state == "banked"
    assert await keys(blobs, doc.run_id) == [doc.scratch.key]
    assert len(await events_of(mongo, doc.run_id, "sandbox_scratch_banked")) == 1


async def test_a_stale_bank_is_refused_and_a_rewind_that_drops_the_node_makes_it_acceptable(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a)
    bank = doc.scratch
    # The next execution runs the `act` tool node, parks at `ask2`, and dies before its
    # teardown could bank: the record is its mark, still naming the bank from before `act`.
    claimed = await claim_local(a, doc, ResumeRequest(answers=WIPE))
    assert claimed.lease is not None
    events = EventLog(mongo, claimed.run_id, claimed.attempt, claimed.lease.token)
    execution = Execution.claimed(a, claimed, _cancel(), events)
    outcome = await execution.run()
    await settle(execution.writer, events, outcome)
    await execution.writer.release()  # no teardown: the crash
    doc = await mongo.get_run(doc.run_id)
    assert marked(doc.scratch, bank, claimed.lease.token) and scratch_problem(doc) is not None
    with pytest.raises(ScratchNotPortable, match="moved past"):
        await resume_local(b, doc.run_id, ResumeRequest(answers={"ok": True}))
    await rewind(mongo, doc.run_id, "act")
    doc = await mongo.get_run(doc.run_id)
    assert scratch_problem(doc) is None
    doc = await resume_local(b, doc.run_id, ResumeRequest())
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN  # `act` ran again on the restored bank
    assert (tmp_path / "b" / "scratch" / doc.run_id / "verify.sh").exists() is False  # wiped


@pytest.mark.parametrize("evil", ["../x", "/etc/evil"])
async def test_an_archive_with_a_dotdot_or_absolute_member_is_refused_and_held(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path, evil: str
) -> None:
    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a)
    rec = doc.scratch
    assert rec is not None and rec.key is not None
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w:gz") as tar:
        info = tarfile.TarInfo(evil)
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    await blobs.put_bytes(rec.key, bad.getvalue())
    doc = await resume_local(b, doc.run_id, ResumeRequest(answers=KEEP))
    assert doc.status is RunStatus.FAILED_RESUMABLE
    assert doc.failure_code == FailureCode.SCRATCH_NOT_PORTABLE
    assert doc.scratch == rec and await keys(blobs, doc.run_id) == [rec.key]  # held
    [restored] = await events_of(mongo, doc.run_id, "sandbox_scratch_restored")
    assert not restored.data["restored"] and "refused" in restored.data["reason"]
    assert not await asyncio.to_thread(_escaped, tmp_path)


def _escaped(tmp_path: Path) -> bool:
    return (tmp_path / "x").exists() or Path("/etc/evil").exists()


async def test_a_bank_that_is_gone_parks_scratch_not_portable(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a)
    assert doc.scratch is not None and doc.scratch.key is not None
    await blobs.delete(doc.scratch.key)
    doc = await resume_local(b, doc.run_id, ResumeRequest(answers=KEEP))
    assert doc.failure_code == FailureCode.SCRATCH_NOT_PORTABLE
    assert doc.scratch is not None and doc.scratch.state == "banked"


async def test_a_blob_read_failing_mid_restore_is_scratch_restore_failed(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a)
    rec = doc.scratch
    blobs.get_fails = True
    doc = await resume_local(b, doc.run_id, ResumeRequest(answers=KEEP))
    assert doc.status is RunStatus.FAILED_RESUMABLE
    assert doc.failure_code == FailureCode.SCRATCH_RESTORE_FAILED
    assert doc.scratch == rec  # held for the retry
    blobs.get_fails = False
    doc = await resume_local(b, doc.run_id, ResumeRequest())
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN


async def test_a_kill_between_upload_and_record_never_restores_a_stale_bank_silently(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.scratch

    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a)
    first = doc.scratch
    assert first is not None

    async def killed(self: Any, result: Any, progress: int) -> None:
        raise asyncio.CancelledError  # the runner dies after the upload, before the record

    monkeypatch.setattr(engine.scratch.ScratchBank, "_record", killed)
    with pytest.raises(asyncio.CancelledError):
        await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP))  # runs `act`, parks
    monkeypatch.undo()
    doc = await mongo.get_run(doc.run_id)
    assert marked(doc.scratch, first) and len(await keys(blobs, doc.run_id)) == 2
    # `act` finished after the bank the record names: refused, never restored silently.
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN  # the status was written before
    await mongo.update_run(doc.run_id, [], Update(unset=["lease"]))  # the lease expired
    doc = await mongo.get_run(doc.run_id)
    with pytest.raises(ScratchNotPortable, match="moved past"):
        await resume_local(b, doc.run_id, ResumeRequest(answers={"ok": True}))


async def test_a_kill_during_restore_holds_the_bank_for_the_next_resume(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = host(mongo, blobs, tmp_path / "a"), host(mongo, blobs, tmp_path / "b")
    doc = await parked(a)
    rec = doc.scratch
    before = tree(tmp_path / "a" / "scratch" / doc.run_id)

    async def killed(self: Any, key: str, path: Path) -> BlobInfo:
        raise asyncio.CancelledError  # the runner dies mid-restore

    monkeypatch.setattr(FlakyBlobs, "get_to_file", killed)
    with pytest.raises(asyncio.CancelledError):
        await resume_local(b, doc.run_id, ResumeRequest(answers=KEEP))
    monkeypatch.undo()
    doc = await mongo.get_run(doc.run_id)
    assert doc.scratch == rec and await keys(blobs, doc.run_id) == [rec.key if rec else ""]
    await mongo.update_run(doc.run_id, [], Update(unset=["lease"]))  # the lease expired
    doc = await resume_local(b, doc.run_id, ResumeRequest())  # adopted from `running`
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN
    assert tree(tmp_path / "b" / "scratch" / doc.run_id) == before


async def test_a_scratch_that_cannot_be_read_keeps_the_previous_record(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.scratch

    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    first = doc.scratch

    def unreadable(src: Path, dest: Path, **kw: Any) -> ArchiveStats:
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(engine.scratch, "make_archive", unreadable)
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP))  # runs `act`, parks
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN
    assert marked(doc.scratch, first)  # `act`'s mark stays: `act` finished after the bank ...
    last = (await events_of(mongo, doc.run_id, "sandbox_scratch_banked"))[-1]
    assert last.data["unknown"] and "Permission denied" in last.data["reason"]
    with pytest.raises(ScratchNotPortable, match="moved past"):  # ... so a resume refuses
        await resume_local(a, doc.run_id, ResumeRequest(answers={"ok": True}))


async def test_a_driver_without_a_host_scratch_banks_and_restores_through_copy_out_and_in(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    """The path a pod takes (copy_out → host re-pack; gunzip → copy_in), driven through the
    local sandbox's own copy_out / copy_in so it runs without a cluster."""
    import shutil

    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    claimed = await claim_local(a, doc, ResumeRequest(answers=KEEP))
    assert claimed.lease is not None
    events = EventLog(mongo, claimed.run_id, claimed.attempt, claimed.lease.token)
    execution = Execution.claimed(a, claimed, _cancel(), events)
    sandbox = await execution.ensure_sandbox()
    scratch = execution.scratch.absolute()
    await sandbox.exec(f'echo copied > "{scratch}/via-copy-out"', timeout_s=10)
    before = tree(scratch)
    bank = _bank_for(execution, blobs, tmp_path / "unused-host-scratch", sandbox_scratch=scratch)
    banked = await bank.bank(sandbox, host_dir=False, process_isolated=True, progress=7)
    assert banked.state == "banked" and banked.unquiesced  # no quiesce ran: said so
    rec = (await mongo.get_run(claimed.run_id)).scratch
    assert rec is not None and rec.progress == 7 and rec.unquiesced
    await asyncio.to_thread(shutil.rmtree, scratch)
    assert await bank.restore(sandbox, rec, host_dir=False, stale=False) is None
    assert tree(scratch) == before
    await execution.teardown(Paused("human", "ask2"))


async def test_the_bank_event_rides_with_its_record_before_older_keys_are_swept(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    """`sandbox_scratch_banked` lands in the same write as the record it describes (ADR-0014),
    and the sweep of older keys comes after: a runner killed anywhere past the record leaves
    no bank unnarrated (the chaos soak's kill during a bank found the window when the sweep
    came between the record and the event). The runner's metrics still hear of it."""
    from engine.scratch import bank_key

    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    claimed = await claim_local(a, doc, ResumeRequest(answers=KEEP))
    assert claimed.lease is not None
    stale = tmp_path / "stale.tgz"
    stale.write_bytes(b"an older bank")
    await blobs.put_file(bank_key(claimed.run_id, "an-older-token"), stale)
    heard: list[str] = []
    events = EventLog(
        mongo,
        claimed.run_id,
        claimed.attempt,
        claimed.lease.token,
        defer=True,
        rider=lambda draft: heard.append(draft.type),
    )
    execution = Execution.claimed(a, claimed, _cancel(), events)
    sandbox = await execution.ensure_sandbox()
    token = claimed.lease.token

    async def mine() -> list[Event]:
        said = await events_of(mongo, claimed.run_id, "sandbox_scratch_banked")
        return [e for e in said if e.execution == token]

    seen_at_sweep: list[list[Event]] = []
    real_delete = blobs.delete

    async def delete(key: str) -> bool:
        seen_at_sweep.append(await mine())
        return await real_delete(key)

    blobs.delete = delete  # type: ignore[method-assign]
    bank = _bank_for(execution, blobs, execution.scratch.absolute())
    banked = await bank.bank(sandbox, host_dir=True, process_isolated=False, progress=3)
    assert banked.state == "banked"
    said = await mine()
    assert len(said) == 1 and said[0].data["banked"] is True
    assert said[0].data["bytes"] == banked.bytes
    assert seen_at_sweep and all(len(s) == 1 for s in seen_at_sweep)  # said before the sweep
    assert await keys(blobs, claimed.run_id) == [bank_key(claimed.run_id, claimed.lease.token)]
    assert heard.count("sandbox_scratch_banked") == 1
    await execution.teardown(Paused("human", "ask2"))


def _bank_for(execution: Execution, blobs: FlakyBlobs, host_scratch: Path, **kw: Any) -> Any:
    """A `ScratchBank` of `execution`, with a 1 MiB cap and a 30 s budget."""
    from engine.scratch import ScratchBank

    return ScratchBank(
        run_id=execution.run_id,
        token=execution.token,
        blobs=blobs,
        writer=execution.writer,
        events=execution.events,
        cap_bytes=1 << 20,
        budget_s=30,
        host_scratch=host_scratch,
        **kw,
    )


class _CopySandbox:
    """A sandbox without a host scratch (a pod's path): what it was asked to copy in."""

    def __init__(self) -> None:
        self.copied_in: list[Path] = []

    async def copy_in(self, tar: Path, dest_dir: Path) -> None:
        self.copied_in.append(dest_dir)


def _flip_crc(data: bytes) -> bytes:
    return data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:]


def _bad_second_header(data: bytes) -> bytes:
    import gzip

    raw = bytearray(gzip.decompress(data))
    raw[2560 + 148 : 2560 + 156] = b"0000000\x00"  # the second member's checksum, wrong
    return gzip.compress(bytes(raw))


CORRUPTIONS = {
    "crc": _flip_crc,
    "cut-trailer": lambda data: data[:-8],
    "cut-crc": lambda data: data[:-5],
    "bad-second-header": _bad_second_header,
}


@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
@pytest.mark.parametrize("host_dir", [True, False], ids=["host-dir", "copy-in"])
async def test_a_corrupt_bank_parks_scratch_not_portable_on_either_restore_path(
    tmp_path: Path, host_dir: bool, corrupt: str
) -> None:
    """A bank that cannot be restored as it was made (a gzip trailer cut off or disagreeing, a
    tar that stops at a bad header) is refused `SCRATCH_NOT_PORTABLE` — held, not transient —
    whether the scratch is a host directory or is copied into a pod, and nothing is written."""
    from engine.scratch import ScratchBank

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.bin").write_bytes(os.urandom(2000))
    archive = tmp_path / "bank.tgz"
    make_archive(src, archive, level=1)
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    key = "runs/r1/scratch/t0.tgz"
    await blobs.put_bytes(key, CORRUPTIONS[corrupt](archive.read_bytes()))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "left").write_text("as it was")
    said = Said()
    bank = ScratchBank(
        run_id="r1",
        token="t1",
        blobs=blobs,
        writer=Records(),  # type: ignore[arg-type]
        events=said,  # type: ignore[arg-type]
        cap_bytes=1 << 20,
        budget_s=30,
        host_scratch=scratch,
    )
    sandbox = _CopySandbox()
    rec = ScratchRecord(state="banked", key=key, bytes=1, progress=1)
    failed = await bank.restore(sandbox, rec, host_dir=host_dir, stale=False)  # type: ignore[arg-type]
    assert failed is not None and failed.code == FailureCode.SCRATCH_NOT_PORTABLE, failed
    assert "corrupt" in failed.error
    assert sandbox.copied_in == []  # refused before a byte went in
    assert tree(scratch) == {"left": b"as it was"}
    [(kind, data)] = said.said
    assert kind == "sandbox_scratch_restored" and data["restored"] is False
    assert data["reason"] == failed.error


def _write_then_pause(name: str, run: str) -> str:
    """A workflow whose tool node runs `run` in the scratch, then pauses (the scratch banks)."""
    return f"""\
name: {name}
entry: write
nodes:
  write:
    kind: tool
    run: >-
      {run}
  ask:
    kind: human
    message: "go on?"
    questions:
      - name: wipe
        type: bool
edges:
  - from: write
    to: ask
"""


ABSOLUTE_LINK = _write_then_pause(
    "venv_like",
    'mkdir -p "$RUNFLEET_SCRATCH_DIR/v/bin" &&'
    ' ln -s /usr/bin/python3 "$RUNFLEET_SCRATCH_DIR/v/bin/python3" && echo written',
)


async def test_a_scratch_with_a_link_no_restore_takes_is_unbankable_naming_it(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    """A venv's absolute `bin/python3` link banked as `banked`, and every resume then failed
    SCRATCH_NOT_PORTABLE "link to an absolute path" (a review of hostile scratches): the bank
    refuses it itself — recorded unbankable, the member and the way out in its reason — and a
    resume is refused at once, as for any scratch that could not be banked."""
    path = tmp_path / "venv_like.yaml"
    path.write_text(ABSOLUTE_LINK)
    a = host(mongo, blobs, tmp_path / "a")
    doc = await run_local(a, load_workflow_file(path), {})
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN, doc
    assert doc.scratch is not None and doc.scratch.state == "unbankable"
    [banked] = await events_of(mongo, doc.run_id, "sandbox_scratch_banked")
    assert not banked.data["banked"]
    assert "'v/bin/python3'" in banked.data["reason"], banked.data
    assert "link to an absolute path" in banked.data["reason"]
    assert await keys(blobs, doc.run_id) == []
    with pytest.raises(ScratchNotPortable):  # the operator surfaces quote the event's reason
        await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP))


SPARSE = _write_then_pause(
    "sparse", 'truncate -s 200G "$RUNFLEET_SCRATCH_DIR/sparse" && echo written'
)


def _archiving() -> bool:
    """Some thread is inside `make_archive` now."""
    return any(
        "make_archive" in {f.f_code.co_name for f in _stack(frame)}
        for frame in sys._current_frames().values()
    )


def _stack(frame: Any) -> Iterator[Any]:
    while frame is not None:
        yield frame
        frame = frame.f_back


async def test_a_bank_past_its_budget_stops_its_reading_thread(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path
) -> None:
    """A thread cannot be cancelled: a bank past its budget went on reading a sparse file in
    its thread for minutes, and `runfleet run` took 4m48s to exit (a review of hostile
    scratches). Its tar now looks at a stop, set when the budget is near or the bank is given
    up on: once the run has paused, nothing is still reading the scratch."""
    path = tmp_path / "sparse.yaml"
    path.write_text(SPARSE)
    big = 1 << 40  # neither the cap nor the plain bound stops it first: only the budget does
    settings = EngineSettings(
        scratch_bank_budget=timedelta(seconds=2), scratch_cap=big, scratch_max_uncompressed=big
    )
    a = host(mongo, blobs, tmp_path / "a", settings)
    doc = await run_local(a, load_workflow_file(path), {})
    assert doc.status is RunStatus.PAUSED_WAITING_HUMAN, doc

    deadline = time.monotonic() + 10
    while _archiving() and time.monotonic() < deadline:  # noqa: ASYNC110 - another thread
        await asyncio.sleep(0.05)
    assert not _archiving(), "a bank's tar is still reading after its budget"
    [banked] = await events_of(mongo, doc.run_id, "sandbox_scratch_banked")
    assert not banked.data["banked"] and "stopped" in banked.data["reason"], banked.data


async def test_a_later_try_never_replaces_a_record_with_less_after_a_record_reply_was_lost(
    mongo: RunStore, blobs: FlakyBlobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC §7.3: files > empty > unknown. The bank's record write landed but raised (a lost
    reply); the retry's tar found the scratch unreadable (its sandbox gone). Recording that
    `unknown` over the landed `banked` would lose a bank that is there: the guard must hold,
    and it could never run before (it was armed only by a record write that succeeded)."""
    import engine.scratch
    from engine.scratch import BankOutcome, ScratchBank
    from store import StoreUnavailable

    a = host(mongo, blobs, tmp_path / "a")
    doc = await parked(a)
    real_record, real_tar = ScratchBank._record, ScratchBank._tar
    calls = {"record": 0, "tar": 0}

    async def lands_then_raises(self: Any, result: Any, progress: int) -> None:
        calls["record"] += 1
        await real_record(self, result, progress)
        if calls["record"] == 1:
            raise StoreUnavailable("the reply was lost (test fault)")

    async def unreadable_the_second_time(self: Any, *args: Any) -> BankOutcome:
        calls["tar"] += 1
        if calls["tar"] >= 2:
            return BankOutcome("unknown", reason="its sandbox is gone (test fault)")
        outcome: BankOutcome = await real_tar(self, *args)
        return outcome

    monkeypatch.setattr(engine.scratch.ScratchBank, "_record", lands_then_raises)
    monkeypatch.setattr(engine.scratch.ScratchBank, "_tar", unreadable_the_second_time)
    doc = await resume_local(a, doc.run_id, ResumeRequest(answers=KEEP))  # runs `act`, parks
    monkeypatch.undo()
    assert calls["tar"] >= 2 and calls["record"] >= 2  # the retry happened
    assert doc.scratch is not None and doc.scratch.state == "banked", doc.scratch
    assert doc.scratch.key in await keys(blobs, doc.run_id)
