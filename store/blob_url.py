"""`open_blob_store(url)`: the one place a blob URL becomes a `BlobStore` (SPEC §9, §12).

- `file:///absolute/path` → `FilesystemBlobStore` rooted there.
- `s3://bucket/optional/prefix` → `S3BlobStore`. The endpoint comes from the URL's
  `?endpoint=http://host:port` or else `RUNFLEET_S3_ENDPOINT` (unset: AWS); the region from
  `?region=`, else `RUNFLEET_S3_REGION`, else `AWS_REGION`, else `us-east-1`. Credentials come
  from the usual AWS chain (environment, profile, instance role), never from the URL.

Anything else is `InvalidStoreUrl` naming the (redacted) URL.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

from store.blobs_fs import FilesystemBlobStore
from store.errors import BlobKeyInvalid, InvalidStoreUrl
from store.protocols import BlobStore
from store.url import redact

if TYPE_CHECKING:
    from store.blobs_s3 import S3BlobStore

DEFAULT_REGION = "us-east-1"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def open_blob_store(url: str, *, env: Mapping[str, str] | None = None) -> BlobStore:
    """The blob store named by `url`. Nothing is contacted until the first operation."""
    environ = os.environ if env is None else env
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise InvalidStoreUrl(f"unsupported blob store URL {redact(url)!r}: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme == "file":
        return _filesystem(url, parts.netloc, parts.path, parts.query)
    if scheme == "s3":
        return _s3(url, parts.netloc, parts.path, parts.query, environ)
    raise InvalidStoreUrl(f"unsupported blob store URL {redact(url)!r}")


def _filesystem(url: str, netloc: str, path: str, query: str) -> FilesystemBlobStore:
    if netloc not in ("", "localhost") or query:
        raise InvalidStoreUrl(
            f"blob store URL {redact(url)!r} is not file:///absolute/path (no host, no query)"
        )
    root = Path(unquote(path))
    if not path or not root.is_absolute():
        raise InvalidStoreUrl(f"blob store URL {redact(url)!r} needs an absolute path")
    return FilesystemBlobStore(root)


def _s3(url: str, netloc: str, path: str, query: str, env: Mapping[str, str]) -> S3BlobStore:
    shown = redact(url)
    if "@" in netloc:
        raise InvalidStoreUrl(
            f"blob store URL {shown!r} carries credentials; use the AWS credential chain instead"
        )
    if not _BUCKET.match(netloc):
        raise InvalidStoreUrl(f"blob store URL {shown!r} does not name a valid S3 bucket")
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise InvalidStoreUrl(f"blob store URL {shown!r} has a malformed query: {exc}") from exc
    unknown = sorted(set(params) - {"endpoint", "region"})
    if unknown or any(len(values) != 1 for values in params.values()):
        raise InvalidStoreUrl(
            f"blob store URL {shown!r}: only one 'endpoint' and one 'region' query parameter "
            f"are understood (got {sorted(params)})"
        )
    endpoint = params.get("endpoint", [""])[0] or env.get("RUNFLEET_S3_ENDPOINT") or None
    if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
        raise InvalidStoreUrl(f"blob store URL {shown!r}: endpoint {endpoint!r} is not http(s)")
    region = (
        params.get("region", [""])[0]
        or env.get("RUNFLEET_S3_REGION")
        or env.get("AWS_REGION")
        or DEFAULT_REGION
    )
    try:
        from store.blobs_s3 import S3BlobStore  # aioboto3 costs a start-up ≈ 0.5 s (ADR-0024)

        return S3BlobStore(netloc, unquote(path), endpoint_url=endpoint, region=region)
    except BlobKeyInvalid as exc:
        raise InvalidStoreUrl(f"blob store URL {shown!r} has an invalid prefix: {exc}") from exc
