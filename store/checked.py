"""Bytes checked against what a record says they are (SPEC §8): the SHA-256 and size of a
local file, and a blob fetched to a file that must be the bytes its record names.

One helper for every such fetch — a staged upload promoted to its run (`store.staging`), a
run's attachments materialised for an execution (`engine.attachments`), a file answer found
already promoted (`engine.attachment_intake`) — so "the bytes came back different" is judged
and worded the same everywhere. Each caller decides what a failure means for it.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from store.errors import StoreCorrupt, StoreError
from store.protocols import BlobStore

_CHUNK = 1024 * 1024


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a local file, read in chunks; an unreadable file is a
    `StoreError` naming it."""
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc}") from exc
    return digest.hexdigest(), size


async def fetch_checked(
    blobs: BlobStore, key: str, dest: Path, *, sha256: str, size: int, what: str
) -> None:
    """Fetch `key` to `dest` and check it is the `size` bytes with digest `sha256` that `what`
    (named in the error) records. The fetch's own errors (`BlobNotFound`, a `StoreError`) pass
    as they are; other bytes are `StoreCorrupt`, naming both digests and sizes. `dest` is left
    in place either way: the caller owns it."""
    await blobs.get_to_file(key, dest)
    digest, got = await asyncio.to_thread(sha256_file, dest)
    if digest != sha256 or got != size:
        raise StoreCorrupt(
            f"{what} ({key}) came back with sha256 {digest} and {got} bytes; its record holds "
            f"{sha256} and {size}"
        )
