"""`BlobStore` on a local directory: the embedded default (SPEC §9).

Every write goes to a temp file in the destination's own directory, is fsynced, then renamed over
the target with `os.replace` (`create_bytes` hard-links it instead, which refuses an existing
target), so a reader sees the old bytes or the new ones, never a torn file,
and a crash leaves at most a stray temp file (named `.rf-tmp-*`, never listed, and refused as a
key segment so it cannot collide with a blob). File I/O runs in worker threads and copies are
streamed; only `put_bytes`/`get_bytes` hold an object in memory.

Keys map to paths under `root`; a key whose resolved path leaves `root` (through a symlink) is
refused as `BlobKeyInvalid`. A key that needs a directory where a blob is (`a/b` when `a` is a
blob) is a `StoreError`: S3 would allow it, a filesystem cannot.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import os
import shutil
import stat as stat_mod
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from store.blobkeys import RESERVED_PREFIX, validate_key, validate_prefix
from store.errors import BlobKeyInvalid, BlobNotFound, StoreError, StoreUnavailable
from store.protocols import BlobInfo
from store.timeutil import from_ms

TEMP_PREFIX = RESERVED_PREFIX
_COPY_CHUNK = 1024 * 1024
_MKDIR_RETRIES = 5


class FilesystemBlobStore:
    """Blobs as files under `root` (created on first write)."""

    def __init__(self, root: Path) -> None:
        self._root = Path(root).absolute()
        self._resolved_root: Path | None = None
        self._closed = False

    @property
    def root(self) -> Path:
        return self._root

    def __repr__(self) -> str:
        return f"FilesystemBlobStore({str(self._root)!r})"

    # -- BlobStore -------------------------------------------------------------------------

    async def put_file(self, key: str, path: Path) -> BlobInfo:
        self._check(key)
        return await asyncio.to_thread(self._put_file_sync, key, Path(path))

    async def put_bytes(self, key: str, data: bytes) -> BlobInfo:
        self._check(key)
        return await asyncio.to_thread(self._put_bytes_sync, key, bytes(data))

    async def create_bytes(self, key: str, data: bytes) -> BlobInfo | None:
        self._check(key)
        return await asyncio.to_thread(self._create_bytes_sync, key, bytes(data))

    async def get_to_file(self, key: str, path: Path) -> BlobInfo:
        self._check(key)
        return await asyncio.to_thread(self._get_to_file_sync, key, Path(path))

    async def get_bytes(self, key: str) -> bytes:
        self._check(key)
        return await asyncio.to_thread(self._get_bytes_sync, key)

    async def stat(self, key: str) -> BlobInfo | None:
        self._check(key)
        return await asyncio.to_thread(self._stat_sync, key)

    async def delete(self, key: str) -> bool:
        self._check(key)
        return await asyncio.to_thread(self._delete_sync, key)

    async def list(self, prefix: str) -> list[BlobInfo]:
        self._check_open()
        validate_prefix(prefix)
        return await asyncio.to_thread(self._list_sync, prefix)

    async def close(self) -> None:
        self._closed = True

    # -- helpers (run in worker threads) ---------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")

    def _check(self, key: str) -> None:
        self._check_open()
        validate_key(key)
        if any(segment.startswith(TEMP_PREFIX) for segment in key.split("/")):
            raise BlobKeyInvalid(
                f"blob key {key!r} is invalid: segments starting with {TEMP_PREFIX!r} are "
                "reserved for the filesystem store's temp files"
            )

    def _real_root(self) -> Path:
        if self._resolved_root is None:
            self._resolved_root = self._root.resolve()
        return self._resolved_root

    def _path(self, key: str) -> Path:
        """The file for `key`, refusing a path that resolves outside the root."""
        path = self._root.joinpath(*key.split("/"))
        if not path.resolve().is_relative_to(self._real_root()):
            raise BlobKeyInvalid(f"blob key {key!r} resolves outside the store root {self._root}")
        return path

    def _put_file_sync(self, key: str, src: Path) -> BlobInfo:
        dest = self._path(key)
        with (
            local_errors(f"cannot read {src}"),
            src.open("rb") as fsrc,
            self._pruned_on_failure(dest),
        ):
            return _atomic_write(key, dest, lambda out: shutil.copyfileobj(fsrc, out, _COPY_CHUNK))

    def _put_bytes_sync(self, key: str, data: bytes) -> BlobInfo:
        dest = self._path(key)
        with self._pruned_on_failure(dest):
            return _atomic_write(key, dest, lambda out: out.write(data))

    def _create_bytes_sync(self, key: str, data: bytes) -> BlobInfo | None:
        dest = self._path(key)
        with self._pruned_on_failure(dest):
            return _atomic_create(key, dest, lambda out: out.write(data))

    @contextlib.contextmanager
    def _pruned_on_failure(self, dest: Path) -> Iterator[None]:
        """A write that failed leaves no directory it made (a disk-full drill: a failed upload
        left an empty `uploads/<id>/`, which `gc` and the upload reaper never looked at)."""
        try:
            yield
        except BaseException:
            self._prune(dest.parent)
            raise

    def _open_blob(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            return path.open("rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise BlobNotFound(f"no blob under key {key!r} in {self._root}") from None
        except OSError as exc:
            raise StoreError(f"cannot read blob {key!r} at {path}: {exc}") from exc

    def _get_to_file_sync(self, key: str, dest: Path) -> BlobInfo:
        with self._open_blob(key) as fsrc:
            info = _info(key, os.fstat(fsrc.fileno()))
            _atomic_write(key, dest, lambda out: shutil.copyfileobj(fsrc, out, _COPY_CHUNK))
        return info

    def _get_bytes_sync(self, key: str) -> bytes:
        with self._open_blob(key) as fsrc, local_errors(f"cannot read blob {key!r}"):
            return fsrc.read()

    def _stat_sync(self, key: str) -> BlobInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"cannot stat blob {key!r}: {exc}") from exc
        return _info(key, st) if stat_mod.S_ISREG(st.st_mode) else None

    def _delete_sync(self, key: str) -> bool:
        path = self._path(key)
        if not path.is_file():
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete blob {key!r} at {path}: {exc}") from exc
        self._prune(path.parent)
        return True

    def _prune(self, directory: Path) -> None:
        """Remove now-empty directories up to (not including) the root. A concurrent writer
        that needs one again recreates it (see `_atomic_write`)."""
        while directory != self._root and directory.is_relative_to(self._root):
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    def _list_sync(self, prefix: str) -> builtins.list[BlobInfo]:
        head = prefix.rpartition("/")[0]
        base = self._root.joinpath(*head.split("/")) if head else self._root
        if not base.is_dir() or not base.resolve().is_relative_to(self._real_root()):
            return []
        found: list[BlobInfo] = []
        for dirpath, _dirnames, filenames in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self._root).as_posix()
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while we walked
                if stat_mod.S_ISREG(st.st_mode):
                    found.append(_info(key, st))
        found.sort(key=lambda info: info.key)
        return found


def _info(key: str, st: os.stat_result) -> BlobInfo:
    return BlobInfo(key=key, size=st.st_size, modified=from_ms(st.st_mtime_ns // 1_000_000))


@contextlib.contextmanager
def local_errors(what: str) -> Iterator[None]:
    """A local file's `OSError` as the store's own error, saying what was being done."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # The disk is full: the store works again once space is freed (a disk-full
            # drill: `upload` said `store_error`, exit 1, with no remedy).
            raise StoreUnavailable(
                f"{what}: {exc}",
                remedy="free space on the disk holding the blob store (`df -h`), then retry",
            ) from exc
        if exc.errno == errno.EROFS:
            raise StoreUnavailable(
                f"{what}: {exc}",
                remedy="the blob store's disk is read-only (remounted after an error?): check"
                " the kernel log and remount it writable, then retry",
            ) from exc
        raise StoreError(f"{what}: {exc}") from exc


def _atomic_write(key: str, dest: Path, write: Callable[[BinaryIO], object]) -> BlobInfo:
    """Write through a temp file in `dest`'s directory, fsync, then rename over `dest`."""
    info = _through_temp(key, dest, write, _replace)
    assert info is not None  # a rename always lands
    return info


def _atomic_create(key: str, dest: Path, write: Callable[[BinaryIO], object]) -> BlobInfo | None:
    """`_atomic_write`, but `os.link` instead of the rename: the link fails when `dest` exists,
    so an existing blob is never replaced, and it appears whole (the temp file was complete and
    fsynced before it got its second name). None when `dest` was there."""
    return _through_temp(key, dest, write, _link_if_absent)


def _replace(key: str, tmp: str, dest: Path) -> bool:
    os.replace(tmp, dest)
    return True


def _link_if_absent(key: str, tmp: str, dest: Path) -> bool:
    try:
        os.link(tmp, dest)
    except FileExistsError:
        if not dest.is_file():  # a directory (`a` when `a/b` is a blob), as put_bytes says
            raise StoreError(f"cannot create blob {key!r}: {dest} is not a file") from None
        return False
    return True


def _through_temp(
    key: str,
    dest: Path,
    write: Callable[[BinaryIO], object],
    land: Callable[[str, str, Path], bool],
) -> BlobInfo | None:
    """Write a temp file in `dest`'s directory, fsync it, and `land` it at `dest` (False: it
    did not, and nothing changed). The temp file never outlives the call."""
    fd, tmp = _mkstemp_in(dest.parent, key)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
            st = os.fstat(out.fileno())
        landed = land(key, tmp, dest)
    except OSError as exc:
        raise StoreError(f"cannot write blob {key!r} to {dest}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # after a rename it is gone already; after a link, a second name
    if not landed:
        return None
    _fsync_dir(dest.parent)
    return _info(key, st)


def _mkstemp_in(directory: Path, key: str) -> tuple[int, str]:
    # A concurrent delete may prune the directory between mkdir and mkstemp: recreate it.
    for _ in range(_MKDIR_RETRIES):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreError(f"cannot write blob {key!r} under {directory}: {exc}") from exc
    raise StoreError(f"cannot write blob {key!r}: {directory} kept disappearing")


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; best effort where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
