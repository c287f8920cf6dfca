"""`open_blob_store(url)`: file:// and s3:// URLs, and the errors for everything else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from store.blob_url import open_blob_store
from store.blobs_fs import FilesystemBlobStore
from store.blobs_s3 import S3BlobStore
from store.errors import InvalidStoreUrl
from tests.support.s3server import S3Server, running_s3_server


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


async def test_file_url_opens_a_filesystem_store(tmp_path: Path) -> None:
    store = open_blob_store(f"file://{tmp_path}/blobs", env={})
    assert isinstance(store, FilesystemBlobStore)
    assert store.root == tmp_path / "blobs"
    await store.put_bytes("a/b", b"x")
    assert (tmp_path / "blobs" / "a" / "b").read_bytes() == b"x"
    await store.close()


def test_s3_url_with_endpoint_query() -> None:
    store = open_blob_store("s3://my-bucket/fleet/blobs?endpoint=http://127.0.0.1:9000", env={})
    assert isinstance(store, S3BlobStore)
    assert (store.bucket, store.prefix) == ("my-bucket", "fleet/blobs/")
    assert store.endpoint_url == "http://127.0.0.1:9000"
    assert store.region == "us-east-1"
    assert store.object_key("runs/r/x") == "fleet/blobs/runs/r/x"


def test_s3_endpoint_and_region_from_the_environment() -> None:
    env = {"RUNFLEET_S3_ENDPOINT": "http://minio:9000", "AWS_REGION": "eu-west-3"}
    store = open_blob_store("s3://bucket", env=env)
    assert isinstance(store, S3BlobStore)
    assert (store.endpoint_url, store.region, store.prefix) == (
        "http://minio:9000",
        "eu-west-3",
        "",
    )

    env["RUNFLEET_S3_REGION"] = "eu-central-1"
    store = open_blob_store("s3://bucket/p?endpoint=https://s3.example.com", env=env)
    assert isinstance(store, S3BlobStore)
    assert store.endpoint_url == "https://s3.example.com", "the URL's endpoint wins"
    assert store.region == "eu-central-1", "RUNFLEET_S3_REGION wins over AWS_REGION"


def test_s3_without_endpoint_uses_aws() -> None:
    store = open_blob_store("s3://bucket/p", env={})
    assert isinstance(store, S3BlobStore)
    assert store.endpoint_url is None


async def test_s3_url_round_trip(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    bucket = await s3_server.new_bucket()
    store = open_blob_store(f"s3://{bucket}/via-url?endpoint={s3_server.endpoint_url}", env={})
    try:
        await store.put_bytes("k", b"v")
        head = await s3_server.head(bucket, "via-url/k")
        assert head["ContentLength"] == 1
        assert await store.get_bytes("k") == b"v"
    finally:
        await store.close()


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "sqlite:///runs.db",
        "relative/path",
        "",
        "file://host/abs/path",
        "file:relative/path",
        "file:///abs?x=1",
        "s3://",
        "s3://Bad_Bucket/x",
        "s3://bucket/../escape",
        "s3://bucket/a//b",
        "s3://bucket?color=blue",
        "s3://bucket?endpoint=ftp://host",
        "s3://bucket?endpoint=http://a&endpoint=http://b",
    ],
)
def test_unsupported_urls_are_refused_naming_the_url(url: str) -> None:
    with pytest.raises(InvalidStoreUrl) as caught:
        open_blob_store(url, env={})
    assert repr(url) in caught.value.message
    assert caught.value.code == "invalid_store_url"


def test_credentials_in_an_s3_url_are_refused_and_redacted() -> None:
    with pytest.raises(InvalidStoreUrl) as caught:
        open_blob_store("s3://key:hunter2@bucket/p", env={})
    assert "hunter2" not in caught.value.message
    assert "credential" in caught.value.message


def test_an_s3_credentials_refusal_says_where_the_credentials_come_from() -> None:
    """Found by a walkthrough: wrong keys were `store_error` with no remedy at all."""
    from botocore.exceptions import ClientError

    from store.blobs_s3 import S3BlobStore

    blobs = S3BlobStore("bkt", "fleet", endpoint_url="http://127.0.0.1:1", region="us-east-1")
    refused = ClientError(
        {
            "Error": {"Code": "InvalidAccessKeyId", "Message": "The key does not exist"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        "PutObject",
    )
    error = blobs._client_error(refused, "writing 'k'", "k", "s3://bkt/fleet")
    assert "InvalidAccessKeyId" in error.message
    assert error.remedy is not None and "AWS_ACCESS_KEY_ID" in error.remedy
    assert "s3://bkt/fleet" in error.remedy
