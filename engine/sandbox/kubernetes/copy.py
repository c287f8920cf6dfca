"""Directories in and out of a sandbox pod as tar streams over exec (SPEC §7.1): `copy_in`
streams a host tar to the pod's `tar -x`, checked on the host first; `copy_out` streams the
pod's `tar -c` into a host file, gzipped on the host at an explicit level (the pod's tar may be
BusyBox's, which takes no level). The exec transport itself is `exec.py`'s.
"""

from __future__ import annotations

import asyncio
import tarfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

from kubernetes.aio.client import CoreV1Api

from engine.sandbox.errors import SandboxArchiveInvalid, SandboxCopyFailed, SandboxCopyTooLarge
from engine.sandbox.kubernetes.exec import STDIN_CHUNK, exec_raw

__all__ = ["copy_in", "copy_out"]


async def copy_in(
    api: CoreV1Api,
    namespace: str,
    pod: str,
    container: str,
    tar_path: Path,
    dest_dir: str,
    *,
    timeout_s: float | None = None,
) -> None:
    """Extract the host tar `tar_path` (plain or gzip) into `dest_dir` in the pod, creating it,
    by streaming it to `tar -x` over stdin. The archive is checked on the host first: a member
    that would escape `dest_dir`, a device file or an absolute link is `SandboxArchiveInvalid`
    and nothing is sent; a failure on the way or of the pod's tar is `SandboxCopyFailed`, and
    so is a copy (the exec, the stream and the pod's `tar -x`) not done within `timeout_s`
    (`None`: the caller bounds it, as the driver's seed phase does)."""
    gzipped = await asyncio.to_thread(_check_archive, tar_path)
    script = 'mkdir -p -- "$1" && exec tar -x -f - -C "$1" ' + ("-z" if gzipped else "")
    argv = ["sh", "-c", script.strip(), "runfleet-copy-in", dest_dir]
    try:
        handle = await asyncio.to_thread(tar_path.open, "rb")
    except OSError as e:
        raise SandboxCopyFailed(f"cannot read {tar_path}: {e}") from e
    try:
        result = await exec_raw(
            api, namespace, pod, container, argv, timeout_s, None, _chunks(handle, tar_path)
        )
    finally:
        handle.close()
    if result.timed_out:  # abandoned by `exec_raw`: its stream is closed
        raise SandboxCopyFailed(
            f"tar in pod {namespace}/{pod} did not extract {tar_path.name} into {dest_dir} "
            f"within its {timeout_s:g}s budget"
        )
    if result.exit_code != 0:
        raise SandboxCopyFailed(
            f"tar in pod {namespace}/{pod} could not extract {tar_path.name} into {dest_dir} "
            f"(exit {result.exit_code}): {result.stderr_tail.decode(errors='replace').strip()}"
        )


async def _chunks(handle: IO[bytes], path: Path) -> AsyncIterator[bytes]:
    while True:
        try:
            chunk = await asyncio.to_thread(handle.read, STDIN_CHUNK)
        except OSError as e:
            raise SandboxCopyFailed(f"cannot read {path}: {e}") from e
        if not chunk:
            return
        yield chunk


def _check_archive(tar_path: Path) -> bool:
    """Whether the archive is gzipped, once every member passed the `data` extraction filter."""
    try:
        with tar_path.open("rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        with tarfile.open(tar_path, "r:*") as tar:
            for member in tar:
                tarfile.data_filter(member, "/runfleet-dest")
    except tarfile.FilterError as e:
        raise SandboxArchiveInvalid(f"{tar_path} has a member that is refused: {e}") from e
    except (tarfile.TarError, EOFError) as e:
        raise SandboxArchiveInvalid(f"{tar_path} is not a readable tar archive: {e}") from e
    except OSError as e:
        raise SandboxCopyFailed(f"cannot read {tar_path}: {e}") from e
    return gzipped


async def copy_out(
    api: CoreV1Api,
    namespace: str,
    pod: str,
    container: str,
    src_dir: str,
    dest_tar: Path,
    *,
    gzip_level: int | None = 6,
    max_bytes: int | None = None,
) -> None:
    """Write the pod's directory `src_dir` as a tar to the host file `dest_tar`, members relative
    to `src_dir`. It is gzipped on the host at `gzip_level` (0-9, always explicit: the pod's tar
    may be BusyBox's, which takes no level), or plain with `gzip_level=None`. On any failure the
    file is removed and `SandboxCopyFailed` (or `SandboxLost`) raised.

    `max_bytes` bounds the tar stream as it arrives (before any gzip): the chunk that would pass
    it is not written, the exec is abandoned at once (its websocket closed, so the pod's `tar`
    stops sending) and `SandboxCopyTooLarge` raised, the partial file removed."""
    if gzip_level is not None and not 0 <= gzip_level <= 9:
        raise ValueError(f"gzip_level must be 0-9 or None, not {gzip_level}")
    try:
        sink = await asyncio.to_thread(_Sink, dest_tar, gzip_level)
    except OSError as e:
        raise SandboxCopyFailed(f"cannot write {dest_tar}: {e}") from e
    received = 0

    async def on_output(stream: str, chunk: bytes) -> None:
        nonlocal received
        if stream != "stdout":
            return
        received += len(chunk)
        if max_bytes is not None and received > max_bytes:
            # raised from `on_output`: `exec_raw` abandons the exec and lets it propagate
            raise SandboxCopyTooLarge(f"{namespace}/{pod}:{src_dir}", max_bytes, received)
        await asyncio.to_thread(sink.write, chunk)

    argv = ["tar", "-c", "-f", "-", "-C", src_dir, "."]
    try:
        result = await exec_raw(api, namespace, pod, container, argv, None, on_output, None)
        if result.exit_code != 0:
            raise SandboxCopyFailed(
                f"tar in pod {namespace}/{pod} could not archive {src_dir} "
                f"(exit {result.exit_code}): {result.stderr_tail.decode(errors='replace').strip()}"
            )
        await asyncio.to_thread(sink.finish)
    except OSError as e:
        await asyncio.to_thread(sink.discard)
        raise SandboxCopyFailed(f"cannot write {dest_tar}: {e}") from e
    except BaseException:
        await asyncio.to_thread(sink.discard)
        raise


class _Sink:
    """The host side of `copy_out`: the tar stream, gzipped or not, into a file."""

    def __init__(self, path: Path, level: int | None) -> None:
        self.path = path
        self.handle = path.open("wb")
        self.gzip = None if level is None else zlib.compressobj(level, zlib.DEFLATED, 31)

    def write(self, chunk: bytes) -> None:
        self.handle.write(chunk if self.gzip is None else self.gzip.compress(chunk))

    def finish(self) -> None:
        if self.gzip is not None:
            self.handle.write(self.gzip.flush())
        self.handle.close()

    def discard(self) -> None:
        self.handle.close()
        self.path.unlink(missing_ok=True)
