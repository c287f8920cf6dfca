"""One `BlobStore` contract, run on every implementation (SPEC §9): the filesystem store and the
S3 store against a real S3-compatible server (moto's, on a free port)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import socket
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from store.blobs_fs import FilesystemBlobStore
from store.blobs_s3 import S3BlobStore
from store.errors import BlobKeyInvalid, BlobNotFound, StoreError, StoreUnavailable
from store.protocols import BlobStore
from store.timeutil import utcnow
from tests.support.s3server import S3Server, running_s3_server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


async def _s3_store(
    server: S3Server, *, multipart_threshold: int = 8 * MiB, list_page_size: int = 1000
) -> S3BlobStore:
    bucket = await server.new_bucket()
    return S3BlobStore(
        bucket,
        "conformance/",
        endpoint_url=server.endpoint_url,
        region=server.region,
        session=server.session(),
        multipart_threshold=multipart_threshold,
        list_page_size=list_page_size,
    )


@pytest.fixture(params=["fs", "s3"])
async def blob_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    store: BlobStore
    if request.param == "fs":
        store = FilesystemBlobStore(tmp_path / "blobs")
    else:
        store = await _s3_store(request.getfixturevalue("s3_server"))
    assert isinstance(store, BlobStore)
    yield store
    await store.close()


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


# -- the contract ---------------------------------------------------------------------------


async def test_bytes_round_trip(blob_store: BlobStore) -> None:
    info = await blob_store.put_bytes("dlq/1.bin", b"hello\x00world")
    assert (info.key, info.size) == ("dlq/1.bin", 11)
    assert await blob_store.get_bytes("dlq/1.bin") == b"hello\x00world"


async def test_file_round_trip(blob_store: BlobStore, tmp_path: Path) -> None:
    src = tmp_path / "src.txt"
    src.write_bytes(b"scratch contents\n" * 100)
    info = await blob_store.put_file("runs/r1/scratch/tok.tgz", src)
    assert (info.key, info.size) == ("runs/r1/scratch/tok.tgz", 1700)

    dest = tmp_path / "out" / "nested" / "copy.txt"
    got = await blob_store.get_to_file("runs/r1/scratch/tok.tgz", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert (got.key, got.size) == ("runs/r1/scratch/tok.tgz", 1700)
    assert [p.name for p in dest.parent.iterdir()] == ["copy.txt"], "no temp file left behind"


async def test_empty_object_round_trips(blob_store: BlobStore, tmp_path: Path) -> None:
    await blob_store.put_bytes("empty", b"")
    assert await blob_store.get_bytes("empty") == b""
    dest = tmp_path / "empty.out"
    assert (await blob_store.get_to_file("empty", dest)).size == 0
    assert dest.read_bytes() == b""


async def test_put_replaces_and_last_writer_wins(blob_store: BlobStore, tmp_path: Path) -> None:
    await blob_store.put_bytes("k/v", b"first version, longer than the second")
    await blob_store.put_bytes("k/v", b"second")
    assert await blob_store.get_bytes("k/v") == b"second"
    stat = await blob_store.stat("k/v")
    assert stat is not None and stat.size == len(b"second")

    src = tmp_path / "third"
    src.write_bytes(b"third")
    await blob_store.put_file("k/v", src)
    assert await blob_store.get_bytes("k/v") == b"third"


async def test_concurrent_replace_is_atomic(blob_store: BlobStore, tmp_path: Path) -> None:
    # Writers of different lengths: a torn or mixed write shows as a value nobody wrote.
    payloads = [bytes([i]) * (100_000 + i * 7919) for i in range(8)]
    for i, data in enumerate(payloads):
        (tmp_path / f"p{i}").write_bytes(data)
    await asyncio.gather(
        *(blob_store.put_file("race/obj", tmp_path / f"p{i}") for i in range(len(payloads)))
    )
    final = await blob_store.get_bytes("race/obj")
    assert final in payloads
    stat = await blob_store.stat("race/obj")
    assert stat is not None and stat.size == len(final)
    assert [b.key for b in await blob_store.list("race/")] == ["race/obj"]


async def test_a_created_blob_is_never_replaced_by_a_later_create(blob_store: BlobStore) -> None:
    created = await blob_store.create_bytes("runs/r/outputs/n/3", b"the adopter's output")
    assert created is not None
    assert (created.key, created.size) == ("runs/r/outputs/n/3", len(b"the adopter's output"))

    assert await blob_store.create_bytes("runs/r/outputs/n/3", b"a fenced execution's") is None
    assert await blob_store.get_bytes("runs/r/outputs/n/3") == b"the adopter's output"
    stat = await blob_store.stat("runs/r/outputs/n/3")
    assert stat is not None and stat.size == len(b"the adopter's output")
    assert [b.key for b in await blob_store.list("runs/r/")] == ["runs/r/outputs/n/3"]


async def test_a_create_refuses_a_key_that_put_wrote(blob_store: BlobStore) -> None:
    await blob_store.put_bytes("k/put", b"put first")
    assert await blob_store.create_bytes("k/put", b"created second") is None
    assert await blob_store.get_bytes("k/put") == b"put first"


async def test_racing_creates_have_exactly_one_winner_whose_bytes_stay(
    blob_store: BlobStore,
) -> None:
    # Lengths differ: a torn or mixed write shows as a value nobody wrote.
    payloads = [bytes([i]) * (50_000 + i * 7919) for i in range(8)]
    results = await asyncio.gather(
        *(blob_store.create_bytes("race/once", data) for data in payloads)
    )
    winners = [i for i, info in enumerate(results) if info is not None]
    assert len(winners) == 1
    assert await blob_store.get_bytes("race/once") == payloads[winners[0]]
    assert [b.key for b in await blob_store.list("race/")] == ["race/once"]


async def test_get_to_file_replaces_the_destination(blob_store: BlobStore, tmp_path: Path) -> None:
    await blob_store.put_bytes("a/b", b"new")
    dest = tmp_path / "dest"
    dest.write_bytes(b"old content that is longer")
    await blob_store.get_to_file("a/b", dest)
    assert dest.read_bytes() == b"new"


async def test_stat(blob_store: BlobStore) -> None:
    before = utcnow()
    await blob_store.put_bytes("runs/r/stat.bin", b"x" * 1234)
    info = await blob_store.stat("runs/r/stat.bin")
    assert info is not None
    assert (info.key, info.size) == ("runs/r/stat.bin", 1234)
    assert info.modified.tzinfo is not None
    # S3 reports whole seconds; allow for that and for a slow machine.
    assert before - timedelta(seconds=2) <= info.modified <= utcnow() + timedelta(seconds=2)


async def test_delete(blob_store: BlobStore) -> None:
    await blob_store.put_bytes("runs/r/x", b"1")
    await blob_store.put_bytes("runs/r/y", b"2")
    assert await blob_store.delete("runs/r/x") is True
    assert await blob_store.stat("runs/r/x") is None
    with pytest.raises(BlobNotFound):
        await blob_store.get_bytes("runs/r/x")
    assert await blob_store.delete("runs/r/x") is False
    assert [b.key for b in await blob_store.list("runs/")] == ["runs/r/y"]


async def test_list_by_prefix_sorted(blob_store: BlobStore) -> None:
    sizes = {
        "runs/b/x": 1,
        "runs/a/2": 2,
        "runs/a/10": 3,
        "uploads/z": 4,
        "runs/a/1": 5,
        "runs-other": 6,
        "runs/a1/y": 7,
        "runs/a/deep/er/k": 8,
    }
    for key, size in sizes.items():
        await blob_store.put_bytes(key, b"." * size)

    listed = await blob_store.list("runs/a/")
    assert [b.key for b in listed] == ["runs/a/1", "runs/a/10", "runs/a/2", "runs/a/deep/er/k"]
    assert [b.size for b in listed] == [5, 3, 2, 8]
    # A prefix matches the key string, not directories.
    assert [b.key for b in await blob_store.list("runs/a")] == [
        "runs/a/1",
        "runs/a/10",
        "runs/a/2",
        "runs/a/deep/er/k",
        "runs/a1/y",
    ]
    assert [b.key for b in await blob_store.list("runs")] == sorted(
        k for k in sizes if k.startswith("runs")
    )
    assert [b.key for b in await blob_store.list("")] == sorted(sizes)
    assert await blob_store.list("nothing/") == []
    assert await blob_store.list("runs/a/1/") == []


async def test_missing_keys(blob_store: BlobStore, tmp_path: Path) -> None:
    with pytest.raises(BlobNotFound, match="no/such/key"):
        await blob_store.get_bytes("no/such/key")
    dest = tmp_path / "dest"
    dest.write_bytes(b"keep me")
    with pytest.raises(BlobNotFound, match="no/such/key"):
        await blob_store.get_to_file("no/such/key", dest)
    assert dest.read_bytes() == b"keep me", "a failed get must not touch the destination"
    assert _names(tmp_path) == ["dest"]
    assert await blob_store.stat("no/such/key") is None
    assert await blob_store.delete("no/such/key") is False


INVALID_KEYS = ["../x", "/abs", "a//b", "a\\b", "a/../b", "./a", "a/", "", "a\x00b", ".."]


@pytest.mark.parametrize("key", INVALID_KEYS)
async def test_invalid_keys_are_refused(blob_store: BlobStore, tmp_path: Path, key: str) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"data")
    attempts = [
        blob_store.put_bytes(key, b"data"),
        blob_store.put_file(key, src),
        blob_store.get_bytes(key),
        blob_store.get_to_file(key, tmp_path / "dest"),
        blob_store.stat(key),
        blob_store.delete(key),
    ]
    for attempt in attempts:
        with pytest.raises(BlobKeyInvalid) as caught:
            await attempt
        assert repr(key) in caught.value.message
        assert caught.value.code == "blob_key_invalid"
    assert _names(tmp_path) == ["src"], "nothing written outside"
    assert await blob_store.list("") == []


@pytest.mark.parametrize("prefix", ["../", "/abs", "a//", "a\\b"])
async def test_invalid_list_prefix_is_refused(blob_store: BlobStore, prefix: str) -> None:
    with pytest.raises(BlobKeyInvalid, match="prefix"):
        await blob_store.list(prefix)


async def test_closed_store_refuses(blob_store: BlobStore) -> None:
    await blob_store.put_bytes("k", b"v")
    await blob_store.close()
    with pytest.raises(StoreError, match="closed"):
        await blob_store.get_bytes("k")
    await blob_store.close()  # idempotent


@pytest.mark.slow
async def test_large_blob_round_trips_byte_identical(
    blob_store: BlobStore, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    size = 40 * MiB + 12345  # not a multiple of the part size: the last part is short
    src = tmp_path / "big.bin"
    with src.open("wb") as out:
        remaining = size
        while remaining:
            chunk = os.urandom(min(MiB, remaining))
            out.write(chunk)
            remaining -= len(chunk)
    expected = _sha256(src)

    info = await blob_store.put_file("runs/big/scratch/t.tgz", src)
    assert info.size == size
    stat = await blob_store.stat("runs/big/scratch/t.tgz")
    assert stat is not None and stat.size == size

    dest = tmp_path / "big.out"
    got = await blob_store.get_to_file("runs/big/scratch/t.tgz", dest)
    assert got.size == size
    assert _sha256(dest) == expected

    if isinstance(blob_store, S3BlobStore):
        server: S3Server = request.getfixturevalue("s3_server")
        head = await server.head(blob_store.bucket, blob_store.object_key("runs/big/scratch/t.tgz"))
        parts = math.ceil(size / blob_store.part_size)
        assert head["ETag"].strip('"').endswith(f"-{parts}"), head["ETag"]


# -- filesystem specifics -------------------------------------------------------------------


async def test_fs_delete_prunes_empty_directories(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    store = FilesystemBlobStore(root)
    await store.put_bytes("runs/r/scratch/a.tgz", b"a")
    await store.put_bytes("runs/q/keep", b"k")
    assert await store.delete("runs/r/scratch/a.tgz")
    assert not (root / "runs" / "r").exists()
    assert (root / "runs" / "q" / "keep").exists()
    assert await store.delete("runs/q/keep")
    assert root.is_dir() and list(root.iterdir()) == []


async def test_fs_refuses_a_key_that_resolves_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    store = FilesystemBlobStore(root)
    with pytest.raises(BlobKeyInvalid, match="link/x"):
        await store.put_bytes("link/x", b"escape")
    assert list(outside.iterdir()) == []


async def test_fs_temp_files_are_never_listed_nor_addressable(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    store = FilesystemBlobStore(root)
    await store.put_bytes("d/real", b"r")
    (root / "d" / ".rf-tmp-leftover").write_bytes(b"crashed writer")
    assert [b.key for b in await store.list("d/")] == ["d/real"]
    with pytest.raises(BlobKeyInvalid):
        await store.get_bytes("d/.rf-tmp-leftover")


async def test_fs_a_create_leaves_no_temp_file_whether_it_wins_or_not(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    store = FilesystemBlobStore(root)
    assert await store.create_bytes("d/once", b"first") is not None
    assert await store.create_bytes("d/once", b"second") is None
    assert _names(root / "d") == ["once"]
    assert (root / "d" / "once").stat().st_nlink == 1


async def test_fs_a_create_over_a_directory_is_a_store_error_not_a_refusal(
    tmp_path: Path,
) -> None:
    store = FilesystemBlobStore(tmp_path / "blobs")
    await store.put_bytes("a/b", b"x")
    with pytest.raises(StoreError, match="not a file"):
        await store.create_bytes("a", b"y")


# -- S3 specifics ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_s3_unreachable_endpoint_is_store_unavailable(s3_server: S3Server) -> None:
    endpoint = f"http://127.0.0.1:{_free_port()}"
    store = S3BlobStore(
        "bucket", endpoint_url=endpoint, session=s3_server.session(), max_attempts=1
    )
    try:
        with pytest.raises(StoreUnavailable, match=endpoint):
            await store.put_bytes("k", b"v")
        with pytest.raises(StoreUnavailable, match=endpoint):
            await store.stat("k")
    finally:
        await store.close()


async def test_s3_missing_bucket_is_a_store_error(s3_server: S3Server) -> None:
    store = S3BlobStore(
        "rf-no-such-bucket",
        endpoint_url=s3_server.endpoint_url,
        session=s3_server.session(),
    )
    try:
        with pytest.raises(StoreError, match="rf-no-such-bucket") as caught:
            await store.put_bytes("k", b"v")
        assert type(caught.value) is StoreError
        assert caught.value.remedy is not None and "bucket" in caught.value.remedy
    finally:
        await store.close()


async def test_s3_prefix_is_prepended(s3_server: S3Server) -> None:
    store = await _s3_store(s3_server)
    try:
        await store.put_bytes("runs/r/x", b"abc")
        head = await s3_server.head(store.bucket, "conformance/runs/r/x")
        assert head["ContentLength"] == 3
        assert [b.key for b in await store.list("")] == ["runs/r/x"]
    finally:
        await store.close()


async def test_s3_failed_multipart_upload_is_aborted(s3_server: S3Server, tmp_path: Path) -> None:
    # A directory stats with a size but cannot be read: the upload starts, then fails.
    store = await _s3_store(s3_server, multipart_threshold=0)
    unreadable = tmp_path / "a-directory"
    unreadable.mkdir()
    try:
        with pytest.raises(StoreError, match="a-directory"):
            await store.put_file("runs/r/scratch/t.tgz", unreadable)
        assert await s3_server.multipart_uploads(store.bucket) == []
        assert await store.stat("runs/r/scratch/t.tgz") is None
    finally:
        await store.close()


async def test_s3_list_follows_pages(s3_server: S3Server) -> None:
    store = await _s3_store(s3_server, list_page_size=2)
    try:
        keys = [f"many/{i:02d}" for i in range(7)]
        for key in reversed(keys):
            await store.put_bytes(key, b"")
        await store.put_bytes("other", b"")
        assert [b.key for b in await store.list("many/")] == keys
    finally:
        await store.close()
