"""The S3 store's large transfers against a real S3-compatible server (moto's), SPEC §9.

The server is steered through botocore's own event hooks on the store's session (a real
extension point of the client, not a mock): a handler runs before a chosen request is built
and changes the server's state, as another writer or a failing network would.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aioboto3
import pytest

from store.blobs_s3 import MIN_PART_SIZE, S3BlobStore
from store.errors import StoreError, StoreUnavailable
from tests.support.s3server import REGION, S3Server, running_s3_server

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


def _session() -> Any:
    """A session of the test's own, so the hooks it registers reach only this test's store."""
    return aioboto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    )


async def _store(server: S3Server, session: Any, *, max_concurrency: int = 4) -> S3BlobStore:
    return S3BlobStore(
        await server.new_bucket(),
        "transfer/",
        endpoint_url=server.endpoint_url,
        region=server.region,
        session=session,
        multipart_threshold=0,
        part_size=MIN_PART_SIZE,
        max_concurrency=max_concurrency,
    )


def _ranged_gets(session: Any) -> list[str]:
    """Record the `Range` of every ranged GetObject the session's clients send (register
    before the store's first request: a client copies its session's hooks when created)."""
    ranges: list[str] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        if "Range" in params:
            ranges.append(params["Range"])

    session.events.register("before-parameter-build.s3.GetObject", record)
    return ranges


async def test_s3_large_read_is_ranged_parts_into_a_temp_file(
    s3_server: S3Server, tmp_path: Path
) -> None:
    session = _session()
    store = await _store(s3_server, session, max_concurrency=2)
    data = os.urandom(2 * MIN_PART_SIZE + 4321)
    ranges = _ranged_gets(session)
    try:
        await store.put_bytes("big", data)
        dest = tmp_path / "out" / "big"
        info = await store.get_to_file("big", dest)
        assert dest.read_bytes() == data
        assert info.size == len(data)
        assert len(ranges) == math.ceil(len(data) / MIN_PART_SIZE)
        assert all(r.startswith("bytes=") for r in ranges), ranges
        assert os.listdir(dest.parent) == ["big"], "no temp file left behind"
    finally:
        await store.close()


async def test_s3_large_read_never_mixes_two_versions(s3_server: S3Server, tmp_path: Path) -> None:
    # One part at a time: the first part is read, then another writer replaces the object.
    session = _session()
    store = await _store(s3_server, session, max_concurrency=1)
    old = b"o" * (2 * MIN_PART_SIZE + 1)
    new = b"n" * len(old)
    ranged: list[str] = []

    async def replace_after_the_first_part(params: dict[str, Any], **_: Any) -> None:
        if "Range" not in params:
            return
        ranged.append(params["Range"])
        if len(ranged) == 2:
            async with s3_server.session().client("s3", endpoint_url=s3_server.endpoint_url) as s3:
                await s3.put_object(Bucket=store.bucket, Key=store.object_key("obj"), Body=new)

    session.events.register("before-parameter-build.s3.GetObject", replace_after_the_first_part)
    try:
        await store.put_bytes("obj", old)
        dest = tmp_path / "obj"
        with pytest.raises(StoreUnavailable, match="changed while reading"):
            await store.get_to_file("obj", dest)
        assert not dest.exists()
        assert os.listdir(tmp_path) == [], "no temp file left behind"
    finally:
        await store.close()


@pytest.mark.slow
async def test_s3_a_part_failing_mid_upload_fails_the_put_and_aborts_it(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # More parts than a reader, a queue and a few uploaders hold at once: a managed upload that
    # waits on a full part queue after its uploaders stopped would hang here.
    session = _session()
    store = await _store(s3_server, session)
    src = tmp_path / "big.bin"
    with src.open("wb") as out:
        out.truncate(10 * MIN_PART_SIZE + 1)

    async def lose_the_upload_at_part_two(params: dict[str, Any], **_: Any) -> None:
        if params["PartNumber"] == 2:
            async with s3_server.session().client("s3", endpoint_url=s3_server.endpoint_url) as s3:
                await s3.abort_multipart_upload(
                    Bucket=params["Bucket"], Key=params["Key"], UploadId=params["UploadId"]
                )

    session.events.register("before-parameter-build.s3.UploadPart", lose_the_upload_at_part_two)
    try:
        async with asyncio.timeout(DEADLINE_S):
            with pytest.raises(StoreError):
                await store.put_file("runs/r/scratch/t.tgz", src)
        assert await s3_server.multipart_uploads(store.bucket) == []
        assert await store.stat("runs/r/scratch/t.tgz") is None
    finally:
        await store.close()
