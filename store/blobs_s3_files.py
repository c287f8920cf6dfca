"""The host-file side of the S3 store's transfers: files read and written in worker threads
(so a large transfer never holds the event loop on the disk), and temp files beside the
destination, renamed into place only when complete. OS errors become `StoreError` naming the
file, here, so the S3 store's translation only ever sees S3's own errors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from store.blobs_fs import TEMP_PREFIX, local_errors
from store.errors import StoreError

__all__ = ["ThreadedWriter", "local_errors", "temp_beside", "write_chunk"]


class ThreadedWriter:
    """The temp file aioboto3 downloads ranged parts into (it seeks, then writes, under its own
    lock), written in a worker thread."""

    def __init__(self, out: BinaryIO, dest: Path) -> None:
        self._out = out
        self._dest = dest

    async def seek(self, offset: int, whence: int = 0) -> int:
        with local_errors(f"cannot write {self._dest}"):
            return await asyncio.to_thread(self._out.seek, offset, whence)

    async def write(self, data: bytes) -> int:
        await asyncio.to_thread(write_chunk, self._out, data, self._dest)
        return len(data)


@contextlib.asynccontextmanager
async def temp_beside(dest: Path) -> AsyncIterator[BinaryIO]:
    """A temp file beside `dest`, renamed onto it (after an fsync) when the block ends cleanly
    and removed otherwise, so `dest` is only ever absent, the old file or the complete new one."""
    out, tmp = await asyncio.to_thread(_open_temp_beside, dest)
    try:
        yield out
        await asyncio.to_thread(_commit_temp, out, tmp, dest)
    except BaseException:
        await asyncio.to_thread(_discard_temp, out, tmp)
        raise


def _open_temp_beside(dest: Path) -> tuple[BinaryIO, str]:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=TEMP_PREFIX)
    except OSError as exc:
        raise StoreError(f"cannot write {dest}: {exc}") from exc
    return os.fdopen(fd, "wb"), tmp


def write_chunk(out: BinaryIO, chunk: bytes, dest: Path) -> None:
    try:
        out.write(chunk)
    except OSError as exc:
        raise StoreError(f"cannot write {dest}: {exc}") from exc


def _commit_temp(out: BinaryIO, tmp: str, dest: Path) -> None:
    try:
        out.flush()
        os.fsync(out.fileno())
        out.close()
        os.replace(tmp, dest)
    except OSError as exc:
        raise StoreError(f"cannot write {dest}: {exc}") from exc


def _discard_temp(out: BinaryIO, tmp: str) -> None:
    out.close()
    with contextlib.suppress(OSError):
        os.unlink(tmp)
