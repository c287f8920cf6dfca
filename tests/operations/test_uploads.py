"""Uploads and a launch's attachments (SPEC §8, §4 Launch) through the operations, on a real
run store (SQLite, mongomock) and a real blob store (filesystem, a local S3 server), with the
session's real nats-server: what the run document lists, what is stored, and what is queued.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from engine.attachments import (
    AttachmentNameInvalid,
    AttachmentTooLarge,
    LaunchFailed,
    TooManyAttachments,
)
from engine.config import EngineSettings
from publisher import WireNames, WireSettings, ensure_streams
from runner import operations as ops
from runner.operations import Env
from runner.operations import uploads as upload_ops
from store import Eq, Refusal, RunQuery, RunStatus, RunStore, StoreUnavailable, Update
from store.blobs_fs import FilesystemBlobStore
from store.blobs_s3 import S3BlobStore
from store.config import StoreSettings
from store.protocols import BlobStore
from store.staging import StagedUploadInUse, StagedUploadInvalid, StagedUploadNotFound, StagingStore
from tests.operations.conftest import ENGINE
from tests.publisher.conftest import Nats, example, stream_messages
from tests.support.s3server import S3Server, running_s3_server


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


@pytest.fixture(params=["fs", "s3"])
async def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    store: BlobStore
    if request.param == "fs":
        store = FilesystemBlobStore(tmp_path / "data" / "blobs")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        store = S3BlobStore(
            await server.new_bucket(),
            "runfleet",
            endpoint_url=server.endpoint_url,
            region=server.region,
            session=server.session(),
        )
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def att_env(
    run_store: RunStore, blobs: BlobStore, wire: WireSettings, nats_conn: Nats, tmp_path: Path
) -> Env:
    await ensure_streams(nats_conn.js, WireNames(wire.namespace), wire)
    settings = StoreSettings(data=tmp_path / "data", tenant="default")
    engine = EngineSettings(**ENGINE)  # type: ignore[arg-type]
    return Env(settings, engine, run_store, blobs, "runfleet-test", wire)


STORES = pytest.mark.parametrize("run_store", ["sqlite", "mongomock"], indirect=True)


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _limited(env: Env, **limits: object) -> Env:
    return replace(env, settings=env.settings.model_copy(update=limits))


async def _nothing_stored(env: Env) -> None:
    assert await env.blobs.list("uploads/") == []
    assert await env.blobs.list("runs/") == []


@STORES
async def test_launch_attach_path_and_upload_id_lists_them_on_the_run_document(
    att_env: Env, tmp_path: Path
) -> None:
    spec = _file(tmp_path, "spec.pdf", b"%PDF spec bytes")
    data = _file(tmp_path, "data.csv", b"a,b\n1,2\n")
    staged = await upload_ops.upload(att_env, data)

    run = await ops.launch(
        att_env,
        example("hello.yaml"),
        {},
        attach_paths={"spec": spec},
        attach_uploads={"table": staged.id},
    )

    held = {a.name: a for a in run.attachments}
    assert set(held) == {"spec", "table"}
    assert (held["spec"].filename, held["spec"].bytes) == ("spec.pdf", 15)
    assert held["table"].filename == "data.csv"
    assert held["table"].sha256 == hashlib.sha256(b"a,b\n1,2\n").hexdigest()
    assert held["table"].key == f"runs/{run.run_id}/attachments/table"
    assert await att_env.blobs.get_bytes(held["spec"].key) == b"%PDF spec bytes"
    assert (await att_env.store.get_run(run.run_id)).attachments == run.attachments
    assert await att_env.blobs.list("uploads/") == []  # promoted uploads are discarded


@STORES
async def test_launch_attach_two_paths_with_the_same_file_name_holds_both(
    att_env: Env, tmp_path: Path
) -> None:
    """`--attach a=x/data.csv --attach b=y/data.csv`: an upload holds its files by file name,
    so one shared upload refused the pair (a walkthrough); each path is its own upload now."""
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    first = _file(tmp_path / "x", "data.csv", b"x-bytes")
    second = _file(tmp_path / "y", "data.csv", b"y-bytes, longer")

    run = await ops.launch(
        att_env, example("hello.yaml"), {}, attach_paths={"a": first, "b": second}
    )

    held = {a.name: a for a in run.attachments}
    assert {n: (a.filename, a.bytes) for n, a in held.items()} == {
        "a": ("data.csv", 7),
        "b": ("data.csv", 15),
    }
    assert await att_env.blobs.get_bytes(held["a"].key) == b"x-bytes"
    assert await att_env.blobs.get_bytes(held["b"].key) == b"y-bytes, longer"
    assert await att_env.blobs.list("uploads/") == []


@STORES
async def test_a_staged_upload_is_invisible_from_another_tenant_and_so_is_a_promoted_one(
    att_env: Env, tmp_path: Path, nats_conn: Nats, names: WireNames
) -> None:
    staged = await upload_ops.upload(att_env, _file(tmp_path, "a.txt", b"mine"), tenant="acme")
    staging = StagingStore(att_env.store, att_env.blobs)

    with pytest.raises(StagedUploadNotFound, match=r"no staged upload"):
        await ops.launch(
            att_env, example("hello.yaml"), {}, tenant="other", attach_uploads={"a": staged.id}
        )
    assert await stream_messages(nats_conn.js, names) == []

    run = await ops.launch(
        att_env, example("hello.yaml"), {}, tenant="acme", attach_uploads={"a": staged.id}
    )
    assert [a.name for a in run.attachments] == ["a"]
    for tenant in ("other", "acme"):  # promoted: no upload is left for anyone to open
        with pytest.raises(StagedUploadNotFound):
            await staging.open(staged.id, tenant, tmp_path / tenant)
    others = await att_env.store.list_runs(RunQuery(tenant="other"))
    assert others.runs == []


@STORES
async def test_an_over_limit_file_is_refused_at_staging_with_the_limit_named_and_nothing_stored(
    att_env: Env, tmp_path: Path, nats_conn: Nats, names: WireNames
) -> None:
    env = _limited(att_env, attachment_max_bytes=10, attachments_max_count=2)
    big = _file(tmp_path, "big.bin", b"x" * 11)

    with pytest.raises(AttachmentTooLarge, match="RUNFLEET_ATTACHMENT_MAX_BYTES \\(10\\)"):
        await upload_ops.upload(env, big)
    with pytest.raises(AttachmentTooLarge, match="RUNFLEET_ATTACHMENT_MAX_BYTES"):
        await ops.launch(env, example("hello.yaml"), {}, attach_paths={"big": big})
    small = {n: _file(tmp_path, f"{n}.txt", b"ok") for n in ("a", "b", "c")}
    with pytest.raises(TooManyAttachments, match="RUNFLEET_ATTACHMENTS_MAX_COUNT \\(2\\)"):
        await ops.launch(env, example("hello.yaml"), {}, attach_paths=small)

    await _nothing_stored(env)
    assert await stream_messages(nats_conn.js, names) == []


@STORES
async def test_a_file_that_is_no_regular_file_or_whose_name_no_key_holds_is_refused_typed(
    att_env: Env, tmp_path: Path
) -> None:
    """Found by a review: `upload /dev/zero` (or a FIFO) hung for good, its size read as 0; a
    file name of bytes that are not UTF-8 was `error [internal]` (a pydantic dump); a name
    starting `.rf-tmp-` was `blob_key_invalid` on file blobs (a 500 over HTTP) and fine on S3.
    Each is `upload_invalid` with a remedy, on every store, before any byte moves."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    odd = {
        "/dev/zero": Path("/dev/zero"),
        "a FIFO": fifo,
        "a directory": tmp_path,
        "not UTF-8": _file(tmp_path, "bad\udcffname", b"x"),
        "reserved": _file(tmp_path, ".rf-tmp-a", b"x"),
    }
    for what, path in odd.items():
        with pytest.raises(StagedUploadInvalid) as refused:
            await asyncio.wait_for(upload_ops.upload(att_env, path), 10)
        said = (refused.value.message, refused.value.remedy or "")
        if what in ("not UTF-8", "reserved"):
            assert "rename" in said[1], (what, said)
        else:
            assert "not a regular file" in said[0] and "regular file" in said[1], (what, said)
    await _nothing_stored(att_env)


@STORES
async def test_attachment_names_are_checked_before_any_byte_moves(
    att_env: Env, tmp_path: Path
) -> None:
    path = _file(tmp_path, "a.txt", b"ok")
    for bad in ("Spec", "1st", "a-b", "x" * 65):
        with pytest.raises(AttachmentNameInvalid, match="must match"):
            await ops.launch(att_env, example("hello.yaml"), {}, attach_paths={bad: path})
    await _nothing_stored(att_env)


@STORES
async def test_a_launch_whose_promotion_fails_queues_nothing(
    att_env: Env, tmp_path: Path, nats_conn: Nats, names: WireNames
) -> None:
    spec = _file(tmp_path, "spec.pdf", b"spec")
    staged = await upload_ops.upload(att_env, _file(tmp_path, "lost.txt", b"lost"))
    (lost,) = staged.files
    await att_env.blobs.delete(lost.key)  # the record is there, its bytes are not

    with pytest.raises(LaunchFailed) as caught:
        await ops.launch(
            att_env,
            example("hello.yaml"),
            {},
            attach_paths={"spec": spec},
            attach_uploads={"lost": staged.id},
        )

    assert caught.value.code == "launch_failed"
    assert await stream_messages(nats_conn.js, names) == []
    assert (await att_env.store.list_runs(RunQuery(tenant="default"))).runs == []
    await _nothing_stored(att_env)  # what this launch staged and promoted is removed


@STORES
async def test_a_failed_launch_leaves_every_upload_id_it_was_given_for_a_retry(
    att_env: Env, tmp_path: Path
) -> None:
    """Found by a walkthrough: each upload was discarded as it was promoted, so a failure on
    a later one (or the size check after them) used up the earlier ids, and the retry the
    remedy named met `upload_not_found`."""
    good = await upload_ops.upload(att_env, _file(tmp_path, "good.txt", b"good"))
    bad = await upload_ops.upload(att_env, _file(tmp_path, "bad.txt", b"bad"))
    await att_env.blobs.delete(bad.files[0].key)  # its bytes are lost

    with pytest.raises(LaunchFailed):
        await ops.launch(
            att_env, example("hello.yaml"), {}, attach_uploads={"a": good.id, "b": bad.id}
        )
    assert await att_env.blobs.list("runs/") == []

    run = await ops.launch(att_env, example("hello.yaml"), {}, attach_uploads={"a": good.id})
    assert [a.name for a in run.attachments] == ["a"]
    assert await att_env.blobs.get_bytes(run.attachments[0].key) == b"good"


@STORES
async def test_a_staged_upload_is_used_once_by_concurrent_launches(
    att_env: Env, tmp_path: Path, nats_conn: Nats, names: WireNames
) -> None:
    """SPEC §8 "used once" under concurrency (found by a walkthrough: ten concurrent launches
    naming one upload id each took a copy). One launch gets the upload; every other is
    refused `upload_not_found` with nothing of it stored or queued."""
    staged = await upload_ops.upload(att_env, _file(tmp_path, "data.csv", b"a,b\n1,2\n"))

    results = await asyncio.gather(
        *(
            ops.launch(att_env, example("hello.yaml"), {}, attach_uploads={"table": staged.id})
            for _ in range(6)
        ),
        return_exceptions=True,
    )

    launched = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(launched) == 1, results
    assert all(isinstance(r, StagedUploadInUse | StagedUploadNotFound) for r in refused), refused
    (run,) = launched
    assert len(await stream_messages(nats_conn.js, names)) == 1
    assert (await att_env.store.list_runs(RunQuery(tenant="default"))).runs[0].run_id == (
        run.run_id
    )
    assert [b.key for b in await att_env.blobs.list("runs/")] == [run.attachments[0].key]
    assert await att_env.blobs.list("uploads/") == []


@STORES
async def test_an_upload_over_the_launchs_limit_is_refused_before_any_byte_moves_and_kept(
    att_env: Env, tmp_path: Path
) -> None:
    staged = await upload_ops.upload(att_env, _file(tmp_path, "big.bin", b"x" * 11))
    env = _limited(att_env, attachment_max_bytes=10)  # the launching shell's lower limit

    with pytest.raises(AttachmentTooLarge, match=r"'big'.*RUNFLEET_ATTACHMENT_MAX_BYTES \(10\)"):
        await ops.launch(env, example("hello.yaml"), {}, attach_uploads={"big": staged.id})
    assert await att_env.blobs.list("runs/") == []

    run = await ops.launch(att_env, example("hello.yaml"), {}, attach_uploads={"big": staged.id})
    assert [a.bytes for a in run.attachments] == [11]  # the id was left for the retry


@STORES
async def test_an_unknown_upload_id_is_refused_upload_not_found_before_any_byte_moves(
    att_env: Env, tmp_path: Path, nats_conn: Nats, names: WireNames
) -> None:
    """A refusal of what the caller named (exit 3, the API's 404), not a failed promotion:
    checked before the launch's own files are staged."""
    spec = _file(tmp_path, "spec.pdf", b"spec")

    with pytest.raises(StagedUploadNotFound) as caught:
        await ops.launch(
            att_env,
            example("hello.yaml"),
            {},
            attach_paths={"spec": spec},
            attach_uploads={"gone": "0" * 32},
        )

    assert isinstance(caught.value, Refusal) and caught.value.code == "upload_not_found"
    assert await stream_messages(nats_conn.js, names) == []
    assert (await att_env.store.list_runs(RunQuery(tenant="default"))).runs == []
    await _nothing_stored(att_env)
    with pytest.raises(StagedUploadNotFound):
        await upload_ops.staged_upload(att_env, "0" * 32)


async def test_gc_deletes_a_settled_runs_attachments(att_env: Env, tmp_path: Path) -> None:
    run = await ops.launch(
        att_env,
        example("hello.yaml"),
        {},
        attach_paths={"spec": _file(tmp_path, "spec.txt", b"spec")},
    )
    await att_env.store.update_run(
        run.run_id,
        [Eq("status", RunStatus.QUEUED), Eq("attempt", 1)],
        Update(set={"status": RunStatus.CANCELLED}),
    )
    assert await att_env.blobs.list(f"runs/{run.run_id}/attachments/") != []

    plan = await ops.plan_gc(att_env, timedelta(seconds=-1))  # a run updated just now counts
    report = await ops.collect_garbage(att_env, plan)

    assert report.runs == 1
    assert await att_env.blobs.list(f"runs/{run.run_id}/") == []


@STORES
async def test_a_launch_whose_promotion_meets_a_blob_outage_reads_as_unreachable(
    att_env: Env, tmp_path: Path, nats_conn: Nats, names: WireNames, monkeypatch: Any
) -> None:
    """Not an internal error: the caller may retry (the API's 503, the CLI's exit 4), and
    nothing was queued."""
    from runner.console.errors import status_for
    from runner.operations import is_unreachable

    async def down(*_: Any, **__: Any) -> None:
        raise StoreUnavailable("blob store: connection refused")

    monkeypatch.setattr(att_env.blobs, "put_file", down)
    with pytest.raises(LaunchFailed) as caught:
        await ops.launch(
            att_env, example("hello.yaml"), {}, attach_paths={"spec": _file(tmp_path, "s", b"s")}
        )
    assert caught.value.code == "launch_failed"
    assert is_unreachable(caught.value)
    assert status_for(caught.value) == 503
    assert await stream_messages(nats_conn.js, names) == []
