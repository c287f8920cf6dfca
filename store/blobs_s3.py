"""`BlobStore` on S3 (or any S3-compatible server) through aioboto3 (SPEC §9).

One client is opened on first use and kept until `close()`. Files above `multipart_threshold` are
uploaded part by part (each part read from the file only when it is sent), and a failed or
cancelled multipart upload is aborted; a bucket lifecycle rule catches the ones an abort could not
reach (`deploy/`). Not aioboto3's `upload_fileobj`: in aioboto3 15.5 a part that fails while its
reader waits on the full part queue hangs the upload for good, and a cancelled one is left open
with its part tasks waiting (`tests/store/test_blobs_s3_transfer.py` pins the failure case).
Objects above the threshold are read with boto3's managed transfer as aioboto3 exposes it
(`download_fileobj` with a `TransferConfig`): ranged parts, `max_concurrency` at a time, pinned
to the ETag read first (`IfMatch`) so the parts never mix two versions, written in a worker
thread to a temp file beside the destination, renamed into place when complete.

botocore and aiohttp errors are translated here, and only here, into `store.errors`:
not found → `BlobNotFound`; unreachable endpoint, timeouts, 5xx/throttling, and an object
replaced while it was read → `StoreUnavailable` (transient) naming the endpoint; anything else →
`StoreError` carrying the S3 error code (aioboto3 wraps a failed part's `ClientError` in a bare
`Exception`: it is unwrapped first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO

import aioboto3
import aiohttp
from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]
from botocore.exceptions import (  # type: ignore[import-untyped]
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from store.blobkeys import validate_key, validate_prefix
from store.blobs_s3_files import ThreadedWriter, local_errors, temp_beside, write_chunk
from store.errors import BlobNotFound, StoreError, StoreUnavailable
from store.protocols import BlobInfo
from store.timeutil import truncate_ms, utcnow

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB
"""S3 refuses smaller parts (except the last)."""
MAX_PARTS = 10_000
_READ_CHUNK = 1 * MiB
_NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
_CHANGED = frozenset({"PreconditionFailed", "412"})
_TRANSIENT = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        # A conditional write raced another write of the key in flight: AWS says retry.
        "ConditionalRequestConflict",
    }
)


class S3BlobStore:
    """Blobs as objects `<prefix>/<key>` in `bucket`."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        session: aioboto3.Session | None = None,
        multipart_threshold: int = 8 * MiB,
        part_size: int = 8 * MiB,
        max_concurrency: int = 4,
        max_attempts: int = 3,
        list_page_size: int = 1000,
    ) -> None:
        if not bucket:
            raise ValueError("S3BlobStore needs a bucket name")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        if multipart_threshold < 0:
            raise ValueError("multipart_threshold must not be negative")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        stripped = prefix.strip("/")
        if stripped:
            validate_key(stripped)
        self.bucket = bucket
        self.prefix = f"{stripped}/" if stripped else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.list_page_size = list_page_size
        self._session = session if session is not None else aioboto3.Session()
        self._config = AioConfig(
            # SigV4 everywhere: botocore presigns with SigV2 in us-east-1 by default, which
            # buckets made since 2020, SSE-KMS objects and most S3-compatibles refuse (found by
            # a walkthrough: `{{ attachments.x.url }}` carried `AWSAccessKeyId=&Signature=`).
            signature_version="s3v4",
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
        )
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._open_lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"S3BlobStore('s3://{self.bucket}/{self.prefix}'{where})"

    @property
    def endpoint(self) -> str:
        """The endpoint named in errors."""
        if self.endpoint_url:
            return self.endpoint_url
        return f"the AWS S3 endpoint for region {self.region or '(default)'}"

    def object_key(self, key: str) -> str:
        """The S3 object key for a blob key (the store's prefix prepended)."""
        return self.prefix + validate_key(key)

    # -- BlobStore -------------------------------------------------------------------------

    async def put_file(self, key: str, path: Path) -> BlobInfo:
        name = self.object_key(key)
        path = Path(path)
        s3 = await self._s3()
        with local_errors(f"cannot read {path}"):
            size = (await asyncio.to_thread(path.stat)).st_size
        if size > self.multipart_threshold:
            return await self._put_multipart(s3, key, name, path, size)
        # At most `multipart_threshold` bytes: the same bound as one part.
        with local_errors(f"cannot read {path}"):
            data = await asyncio.to_thread(path.read_bytes)
        return await self._put_object(s3, key, name, data)

    async def put_bytes(self, key: str, data: bytes) -> BlobInfo:
        name = self.object_key(key)
        return await self._put_object(await self._s3(), key, name, bytes(data))

    async def create_bytes(self, key: str, data: bytes) -> BlobInfo | None:
        """S3's conditional write (`If-None-Match: *`): 412 when the object exists. A retry of
        a create whose reply was lost also gets 412, so the caller compares what is there. An
        S3-compatible server that ignores the header overwrites: it must honour conditional
        writes (AWS S3 does since August 2024, and moto 5.2, the tests' server; check others)."""
        name = self.object_key(key)
        s3 = await self._s3()
        with self._translate("creating", key):
            try:
                resp = await s3.put_object(
                    Bucket=self.bucket, Key=name, Body=bytes(data), IfNoneMatch="*"
                )
            except ClientError as exc:
                if _status(exc) == 412 or _code(exc) in _CHANGED:
                    return None
                raise
        return BlobInfo(key=key, size=len(data), modified=_server_time(resp))

    async def get_to_file(self, key: str, path: Path) -> BlobInfo:
        name = self.object_key(key)
        dest = Path(path)
        s3 = await self._s3()
        with self._translate("inspecting", key):
            head = await s3.head_object(Bucket=self.bucket, Key=name)
        if head["ContentLength"] <= self.multipart_threshold:
            return await self._get_streamed(s3, key, name, dest)
        async with temp_beside(dest) as out:
            with self._translate("reading", key):
                await _unwrapped(
                    s3.download_fileobj(
                        self.bucket,
                        name,
                        ThreadedWriter(out, dest),
                        ExtraArgs={"IfMatch": head["ETag"]},
                        Config=self._transfer_config(),
                    )
                )
        return BlobInfo(key=key, size=head["ContentLength"], modified=_aware(head))

    async def get_bytes(self, key: str) -> bytes:
        name = self.object_key(key)
        s3 = await self._s3()
        with self._translate("reading", key):
            resp = await s3.get_object(Bucket=self.bucket, Key=name)
            body = resp["Body"]
            async with body:
                data: bytes = await body.read()
        return data

    async def stat(self, key: str) -> BlobInfo | None:
        name = self.object_key(key)
        s3 = await self._s3()
        try:
            with self._translate("inspecting", key):
                resp = await s3.head_object(Bucket=self.bucket, Key=name)
        except BlobNotFound:
            return None
        return BlobInfo(key=key, size=resp["ContentLength"], modified=_aware(resp))

    async def presigned_url(self, key: str, expires_s: int) -> str:
        """A time-limited URL that reads `key` (`{{ attachments.x.url }}`, SPEC §8). Signed
        locally: no request is made, so it works while S3 is unreachable (the read may not)."""
        s3 = await self._s3()
        with self._translate("signing", key):
            url: str = await s3.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self.object_key(key)},
                ExpiresIn=expires_s,
            )
        return url

    async def delete(self, key: str) -> bool:
        """True if the object existed. S3 deletes are idempotent and say nothing, so this asks
        first: two racing deletes may both answer True."""
        if await self.stat(key) is None:
            return False
        s3 = await self._s3()
        with self._translate("deleting", key):
            await s3.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        return True

    async def list(self, prefix: str) -> list[BlobInfo]:
        validate_prefix(prefix)
        s3 = await self._s3()
        found: list[BlobInfo] = []
        with self._translate("listing", prefix):
            paginator = s3.get_paginator("list_objects_v2")
            pages = paginator.paginate(
                Bucket=self.bucket,
                Prefix=self.prefix + prefix,
                PaginationConfig={"PageSize": self.list_page_size},
            )
            async for page in pages:
                for obj in page.get("Contents", ()):
                    found.append(
                        BlobInfo(
                            key=obj["Key"][len(self.prefix) :],
                            size=obj["Size"],
                            modified=_utc(obj["LastModified"]),
                        )
                    )
        found.sort(key=lambda info: info.key)
        return found

    async def close(self) -> None:
        """Close the client; idempotent. The store cannot be used afterwards."""
        self._closed = True
        self._client = None
        await self._stack.aclose()

    # -- internals -------------------------------------------------------------------------

    async def _s3(self) -> Any:
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        if self._client is None:
            async with self._open_lock:
                if self._client is None:
                    with self._translate("opening a client", None):
                        self._client = await self._stack.enter_async_context(
                            self._session.client(
                                "s3",
                                endpoint_url=self.endpoint_url,
                                region_name=self.region,
                                config=self._config,
                            )
                        )
        return self._client

    async def _put_object(self, s3: Any, key: str, name: str, data: bytes) -> BlobInfo:
        with self._translate("writing", key):
            resp = await s3.put_object(Bucket=self.bucket, Key=name, Body=data)
        return BlobInfo(key=key, size=len(data), modified=_server_time(resp))

    def _transfer_config(self) -> TransferConfig:
        # Each ranged part is held whole until written: memory holds max_concurrency parts.
        return TransferConfig(
            multipart_threshold=max(1, self.multipart_threshold),
            multipart_chunksize=self.part_size,
            max_concurrency=self.max_concurrency,
        )

    async def _put_multipart(self, s3: Any, key: str, name: str, path: Path, size: int) -> BlobInfo:
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        with self._translate("starting a multipart upload", key):
            created = await s3.create_multipart_upload(Bucket=self.bucket, Key=name)
        upload_id = created["UploadId"]
        try:
            with local_errors(f"cannot read {path}"):
                src: BinaryIO = await asyncio.to_thread(path.open, "rb")
            try:
                parts: list[dict[str, Any]] = []
                total = 0
                while True:
                    with local_errors(f"cannot read {path}"):
                        chunk = await asyncio.to_thread(src.read, part_size)
                    if not chunk:
                        break
                    number = len(parts) + 1
                    with self._translate(f"uploading part {number}", key):
                        resp = await s3.upload_part(
                            Bucket=self.bucket,
                            Key=name,
                            UploadId=upload_id,
                            PartNumber=number,
                            Body=chunk,
                        )
                    parts.append({"ETag": resp["ETag"], "PartNumber": number})
                    total += len(chunk)
            finally:
                src.close()
            with self._translate("completing a multipart upload", key):
                done = await s3.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            await self._abort(s3, key, name, upload_id)
            raise
        return BlobInfo(key=key, size=total, modified=_server_time(done))

    async def _abort(self, s3: Any, key: str, name: str, upload_id: str) -> None:
        # Best effort: the original failure is what the caller needs to see.
        with contextlib.suppress(StoreError), self._translate("aborting an upload", key):
            await s3.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)

    async def _get_streamed(self, s3: Any, key: str, name: str, dest: Path) -> BlobInfo:
        """One GET, streamed: below the threshold a ranged transfer buys nothing."""
        with self._translate("reading", key):
            resp = await s3.get_object(Bucket=self.bucket, Key=name)
            body = resp["Body"]  # entered as itself: its __aenter__ yields the raw response
            async with body, temp_beside(dest) as out:
                # body.read (not the raw stream) so botocore checks the content length.
                while chunk := await body.read(_READ_CHUNK):
                    await asyncio.to_thread(write_chunk, out, chunk, dest)
        return BlobInfo(key=key, size=resp["ContentLength"], modified=_aware(resp))

    @contextlib.contextmanager
    def _translate(self, action: str, key: str | None) -> Iterator[None]:
        what = f"{action} {key!r}" if key is not None else action
        where = f"s3://{self.bucket}/{self.prefix}"
        try:
            yield
        except ClientError as exc:
            raise self._client_error(exc, what, key, where) from exc
        except (BotoConnectionError, HTTPClientError, aiohttp.ClientError) as exc:
            raise StoreUnavailable(
                f"S3 endpoint {self.endpoint} unreachable while {what} in {where}: {exc}"
            ) from exc
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StoreError(
                f"no usable S3 credentials while {what} in {where}: {exc}",
                remedy="set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an AWS profile",
            ) from exc
        except BotoCoreError as exc:
            raise StoreError(f"S3 failed while {what} in {where}: {exc}") from exc

    def _client_error(self, exc: Any, what: str, key: str | None, where: str) -> StoreError:
        code = _code(exc)
        message = str(exc.response.get("Error", {}).get("Message", "")) or str(exc)
        status = _status(exc)
        if code == "NoSuchBucket":
            return StoreError(
                f"S3 bucket {self.bucket!r} does not exist at {self.endpoint}",
                remedy="create the bucket or fix RUNFLEET_BLOB_URL",
            )
        if code in _NOT_FOUND or (status == 404 and key is not None):
            return BlobNotFound(f"no blob under key {key!r} in {where}")
        if code in _CHANGED or status == 412:
            return StoreUnavailable(f"the object changed while {what} in {where}; read it again")
        if code in _TRANSIENT or (isinstance(status, int) and status >= 500):
            return StoreUnavailable(
                f"S3 at {self.endpoint} failed while {what} in {where}: {code}: {message}"
            )
        if code in _DENIED or status in (401, 403):
            return StoreError(
                f"S3 refused {what} in {where}: {code or status}: {message}",
                remedy="check the credentials this shell gives S3 (AWS_ACCESS_KEY_ID /"
                " AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the pod's role; they are never shared"
                " through fleet-settings.json) and that they may read and write"
                f" s3://{self.bucket}/{self.prefix}",
            )
        return StoreError(
            f"S3 refused {what} in {where}: {code or status}: {message}",
            remedy="read the S3 error above; RUNFLEET_BLOB_URL, RUNFLEET_S3_ENDPOINT and"
            " RUNFLEET_S3_REGION say where the blobs are",
        )


_DENIED = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
"""Refusals of the caller's credentials or rights: said with where credentials come from."""


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: Any) -> Any:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


async def _unwrapped(download: Awaitable[None]) -> None:
    """Await an aioboto3 download, re-raising the S3 answer it wraps in a bare `Exception`."""
    try:
        await download
    except Exception as exc:
        cause = exc.__cause__
        if type(exc) is Exception and isinstance(cause, ClientError):
            raise cause from None
        raise


def _utc(value: datetime) -> datetime:
    return truncate_ms(value.astimezone(UTC))


def _aware(resp: dict[str, Any]) -> datetime:
    last: datetime | None = resp.get("LastModified")
    return _utc(last) if last is not None else _server_time(resp)


def _server_time(resp: dict[str, Any]) -> datetime:
    """The server's clock (the `Date` header), so put and stat report the same clock."""
    header = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if header:
        with contextlib.suppress(TypeError, ValueError):
            return _utc(parsedate_to_datetime(header))
    return utcnow()
