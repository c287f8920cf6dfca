"""Staged uploads (SPEC §8) on the real SQLite run store and each blob store."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from store.blobs_fs import FilesystemBlobStore
from store.blobs_s3 import S3BlobStore
from store.errors import StoreCorrupt, StoreError
from store.models import StagedFile, StagedUpload
from store.protocols import BlobStore
from store.sqlite import SqliteRunStore
from store.staging import StagedUploadInvalid, StagedUploadNotFound, StagingStore
from store.timeutil import utcnow
from tests.support.s3server import S3Server, running_s3_server


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


@pytest.fixture
async def runs(tmp_path: Path) -> AsyncIterator[SqliteRunStore]:
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    yield store
    await store.close()


@pytest.fixture(params=["fs", "s3"])
async def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    store: BlobStore
    if request.param == "fs":
        store = FilesystemBlobStore(tmp_path / "blobs")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        store = S3BlobStore(
            await server.new_bucket(),
            "staging",
            endpoint_url=server.endpoint_url,
            region=server.region,
            session=server.session(),
        )
    yield store
    await store.close()


@pytest.fixture
def staging(runs: SqliteRunStore, blobs: BlobStore) -> StagingStore:
    return StagingStore(runs, blobs)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "in1").mkdir()
    (tmp_path / "in2").mkdir()
    report = tmp_path / "in1" / "report.txt"
    report.write_text("quarterly numbers\n")
    data = tmp_path / "in2" / "data.bin"
    data.write_bytes(bytes(range(256)) * 64)
    return {"report": report, "dataset": data}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_stage_writes_bytes_then_a_tenant_scoped_record(
    staging: StagingStore, runs: SqliteRunStore, blobs: BlobStore, files: dict[str, Path]
) -> None:
    upload = await staging.stage("acme", files)

    assert re.fullmatch(r"[0-9a-f]{32}", upload.id), "128 random bits, hex"
    assert upload.tenant == "acme"
    assert {f.name: f for f in upload.files} == {
        "report": StagedFile(
            name="report",
            filename="report.txt",
            bytes=files["report"].stat().st_size,
            sha256=_sha(files["report"]),
            key=f"uploads/{upload.id}/report.txt",
        ),
        "dataset": StagedFile(
            name="dataset",
            filename="data.bin",
            bytes=256 * 64,
            sha256=_sha(files["dataset"]),
            key=f"uploads/{upload.id}/data.bin",
        ),
    }
    assert await runs.get_staged_upload(upload.id, "acme") == upload
    listed = await blobs.list(f"uploads/{upload.id}/")
    assert [b.key for b in listed] == [
        f"uploads/{upload.id}/data.bin",
        f"uploads/{upload.id}/report.txt",
    ]
    assert await blobs.get_bytes(f"uploads/{upload.id}/report.txt") == b"quarterly numbers\n"


async def test_ids_differ(staging: StagingStore, files: dict[str, Path]) -> None:
    first = await staging.stage("acme", files)
    second = await staging.stage("acme", files)
    assert first.id != second.id


async def test_open_materialises_the_files(
    staging: StagingStore, files: dict[str, Path], tmp_path: Path
) -> None:
    upload = await staging.stage("acme", files)
    dest = tmp_path / "materialised"
    opened = await staging.open(upload.id, "acme", dest)
    assert opened == {"report": dest / "report.txt", "dataset": dest / "data.bin"}
    for name, path in opened.items():
        assert path.read_bytes() == files[name].read_bytes()


async def test_another_tenant_cannot_open_discard_or_promote(
    staging: StagingStore,
    runs: SqliteRunStore,
    blobs: BlobStore,
    files: dict[str, Path],
    tmp_path: Path,
) -> None:
    upload = await staging.stage("acme", files)

    with pytest.raises(StagedUploadNotFound) as caught:
        await staging.open(upload.id, "globex", tmp_path / "stolen")
    assert caught.value.code == "upload_not_found"
    assert upload.id in caught.value.message
    assert not (tmp_path / "stolen").exists()

    assert await staging.discard(upload.id, "globex") is False
    with pytest.raises(StagedUploadNotFound):
        await staging.promote(upload.id, "globex", "run-1")

    # Untouched for its owner.
    assert await runs.get_staged_upload(upload.id, "acme") == upload
    assert len(await blobs.list(f"uploads/{upload.id}/")) == 2
    assert await blobs.list("runs/") == []
    assert set(await staging.open(upload.id, "acme", tmp_path / "mine")) == {"report", "dataset"}


async def test_unknown_upload_is_not_found(staging: StagingStore, tmp_path: Path) -> None:
    with pytest.raises(StagedUploadNotFound, match="0" * 32):
        await staging.open("0" * 32, "acme", tmp_path)
    assert await staging.discard("0" * 32, "acme") is False


async def test_discard_removes_bytes_and_record(
    staging: StagingStore,
    runs: SqliteRunStore,
    blobs: BlobStore,
    files: dict[str, Path],
    tmp_path: Path,
) -> None:
    upload = await staging.stage("acme", files)
    assert await staging.discard(upload.id, "acme") is True
    assert await runs.get_staged_upload(upload.id, "acme") is None
    assert await blobs.list(f"uploads/{upload.id}/") == []
    with pytest.raises(StagedUploadNotFound):
        await staging.open(upload.id, "acme", tmp_path / "gone")
    assert await staging.discard(upload.id, "acme") is False


async def test_discard_deletes_bytes_before_the_record(
    staging: StagingStore, runs: SqliteRunStore, blobs: BlobStore, files: dict[str, Path]
) -> None:
    upload = await staging.stage("acme", files)
    # A blob store that fails every delete: the record must survive, so nothing orphans bytes.
    await blobs.close()
    with pytest.raises(StoreError):
        await staging.discard(upload.id, "acme")
    assert await runs.get_staged_upload(upload.id, "acme") == upload


async def test_discard_cleans_up_a_record_whose_bytes_are_gone(
    staging: StagingStore, runs: SqliteRunStore, blobs: BlobStore, files: dict[str, Path]
) -> None:
    # What a crash between "bytes deleted" and "record deleted" leaves behind.
    upload = await staging.stage("acme", files)
    for staged in upload.files:
        await blobs.delete(staged.key)
    assert await staging.discard(upload.id, "acme") is True
    assert await runs.get_staged_upload(upload.id, "acme") is None


async def _old_upload(
    runs: SqliteRunStore, blobs: BlobStore, tenant: str, age: timedelta, index: int
) -> StagedUpload:
    upload_id = f"{index:032x}"
    key = f"uploads/{upload_id}/old.txt"
    await blobs.put_bytes(key, b"old")
    record = StagedUpload(
        id=upload_id,
        tenant=tenant,
        files=[
            StagedFile(
                name="old",
                filename="old.txt",
                bytes=3,
                sha256=hashlib.sha256(b"old").hexdigest(),
                key=key,
            )
        ],
        created_at=utcnow() - age,
    )
    await runs.put_staged_upload(record)
    return record


async def test_reap_discards_only_old_uploads_of_every_tenant(
    staging: StagingStore, runs: SqliteRunStore, blobs: BlobStore, files: dict[str, Path]
) -> None:
    fresh = await staging.stage("acme", files)
    old_acme = await _old_upload(runs, blobs, "acme", timedelta(days=3), 1)
    old_globex = await _old_upload(runs, blobs, "globex", timedelta(days=2), 2)

    assert await staging.reap(timedelta(days=1), utcnow()) == 2

    for old in (old_acme, old_globex):
        assert await runs.get_staged_upload(old.id, old.tenant) is None
        assert await blobs.list(f"uploads/{old.id}/") == []
    assert await runs.get_staged_upload(fresh.id, "acme") == fresh
    assert len(await blobs.list(f"uploads/{fresh.id}/")) == 2
    assert await staging.reap(timedelta(days=1), utcnow()) == 0


async def test_reap_goes_past_one_batch(
    staging: StagingStore, runs: SqliteRunStore, blobs: BlobStore
) -> None:
    for i in range(105):
        record = StagedUpload(
            id=f"{i:032x}", tenant="acme", created_at=utcnow() - timedelta(hours=2)
        )
        await runs.put_staged_upload(record)
    assert await staging.reap(timedelta(hours=1), utcnow()) == 105
    assert await runs.list_staged_uploads_before(utcnow()) == []


async def test_promote_copies_to_the_run_and_discards_the_upload(
    staging: StagingStore, runs: SqliteRunStore, blobs: BlobStore, files: dict[str, Path]
) -> None:
    upload = await staging.stage("acme", files)
    promoted = await staging.promote(upload.id, "acme", "run-7")

    by_name = {f.name: f for f in promoted}
    assert set(by_name) == {"report", "dataset"}
    for name, path in files.items():
        staged = by_name[name]
        assert staged.key == f"runs/run-7/attachments/{name}"
        assert staged.filename == path.name
        assert staged.sha256 == _sha(path)
        assert await blobs.get_bytes(staged.key) == path.read_bytes()
    assert await runs.get_staged_upload(upload.id, "acme") is None
    assert await blobs.list("uploads/") == []


async def test_promote_refuses_tampered_bytes_and_leaves_the_upload(
    staging: StagingStore,
    runs: SqliteRunStore,
    blobs: BlobStore,
    files: dict[str, Path],
    tmp_path: Path,
) -> None:
    upload = await staging.stage("acme", files)
    tampered = next(f for f in upload.files if f.name == "dataset")
    await blobs.put_bytes(tampered.key, b"not what was staged")

    with pytest.raises(StoreCorrupt, match="dataset"):
        await staging.promote(upload.id, "acme", "run-8")
    assert await blobs.list("runs/") == [], "a failed promotion removes what it copied"
    assert await runs.get_staged_upload(upload.id, "acme") == upload
    with pytest.raises(StoreCorrupt, match="dataset"):
        await staging.open(upload.id, "acme", tmp_path / "out")


async def test_stage_refuses_names_it_cannot_store(
    staging: StagingStore, blobs: BlobStore, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "same.txt").write_text("a")
    (tmp_path / "b" / "same.txt").write_text("b")
    with pytest.raises(StagedUploadInvalid, match=r"same\.txt"):
        await staging.stage(
            "acme", {"x": tmp_path / "a" / "same.txt", "y": tmp_path / "b" / "same.txt"}
        )
    with pytest.raises(StagedUploadInvalid, match="attachment name"):
        await staging.stage("acme", {"a/b": tmp_path / "a" / "same.txt"})
    with pytest.raises(StagedUploadInvalid, match="tenant"):
        await staging.stage("", {"x": tmp_path / "a" / "same.txt"})
    assert await blobs.list("") == []


async def test_a_name_over_255_utf8_bytes_is_refused_before_any_byte_moves(
    staging: StagingStore, blobs: BlobStore, tmp_path: Path
) -> None:
    """200 'é' are 200 characters but 400 bytes: past every common filesystem's name limit,
    so refused as a name (`blobkeys.validate_segment`), not an `OSError` half-way through."""
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(StagedUploadInvalid, match="longer than 255 bytes"):
        await staging.stage("acme", {"é" * 200: tmp_path / "a.txt"})
    assert await blobs.list("") == []


async def test_a_failed_stage_leaves_no_bytes_and_no_record(
    staging: StagingStore,
    runs: SqliteRunStore,
    blobs: BlobStore,
    files: dict[str, Path],
    tmp_path: Path,
) -> None:
    with pytest.raises(StoreError, match=r"missing\.txt"):
        await staging.stage("acme", {**files, "missing": tmp_path / "missing.txt"})
    assert await blobs.list("") == []
    assert await runs.list_staged_uploads_before(utcnow() + timedelta(hours=1)) == []
