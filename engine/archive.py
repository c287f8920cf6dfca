"""The one archive module: every tar runfleet makes or opens goes through here (STYLE.md).

The scratch bank (SPEC §7.3), its restore (§7.4) and attachments (§8) all need the same two
things, and each is easy to get subtly wrong in its own copy:

- *making* a gzip tar of a directory that something may still be writing to. Python's `tarfile`
  does not notice a file changing under it (and raises half-way through a member when one
  shrinks, leaving a broken stream), so every regular file is stat'ed before and after it is
  read; a member whose size, mtime, ctime or inode moved is named in `ArchiveStats.raced` and a
  caller may tar again. A short read is padded to the size the header promised, so the archive
  stays well-formed whatever happened to the file. The gzip level is always explicit (level 1
  is about 2.5 times faster than `tar czf`'s default 6 on mixed trees; see adr/0011). The tar
  stream is built here (GNU headers written directly, one `scandir` walk) while worker threads
  deflate the previous chunks: zlib releases the GIL, so the per-member Python work and the
  compression overlap instead of adding up (docs/performance.md §6).
- *opening* an archive someone else made: gzip and tar structure (the whole gzip stream read to
  its trailer, CRC-32 and length checked, and the tar read to its end: a bad header after the
  first must not pass for a shorter archive), no absolute member, no `..`, no link that points
  out of the destination, no device, fifo or socket, and a cap — all checked on the host before
  a single byte is written (`check_archive`), then extracted with the standard library's `data`
  filter as a second fence (`safe_extract`). A corrupt archive is `ArchiveRefused`.

Both take a `cap_bytes` on the *compressed* archive: that is what is stored and moved.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import stat
import struct
import tarfile
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from store.errors import RunfleetError

__all__ = [
    "ArchiveError",
    "ArchiveOverCap",
    "ArchiveRefused",
    "ArchiveStats",
    "check_archive",
    "make_archive",
    "safe_extract",
]

_CHUNK = 1024 * 1024
"""Tar bytes handed to a compressor at a time (and the largest single read of a file)."""
_WORKERS = 2
"""Compressor threads: the machines this runs on have at least two cores."""


class ArchiveError(RunfleetError, code="archive_error"):
    """An archive could not be made or opened."""


class ArchiveOverCap(ArchiveError, code="archive_over_cap"):
    """The compressed archive grew past its cap while being made; nothing usable was written."""

    def __init__(self, written: int, cap_bytes: int) -> None:
        self.written = written
        self.cap_bytes = cap_bytes
        super().__init__(f"archive reached {written} bytes, over its cap of {cap_bytes} bytes")


class ArchiveOverBound(ArchiveError, code="archive_over_bound"):
    """The plain tar grew past its bound (`RUNFLEET_SCRATCH_MAX_UNCOMPRESSED`) while being made:
    a sparse or zero-filled file compresses ~200:1, so the compressed cap alone let a bank read
    tens of GiB first (found by a review of hostile scratches)."""

    def __init__(self, plain: int, bound: int) -> None:
        self.plain = plain
        self.bound = bound
        super().__init__(f"the scratch's plain tar reached {plain} bytes, over its bound {bound}")


class ArchiveStopped(ArchiveError, code="archive_stopped"):
    """Making the archive was stopped: its time ran out, or its caller gave up. A thread cannot
    be cancelled, so the writer looks at its stop between chunks and members; before, a bank
    past its budget went on reading in its thread for minutes, holding a worker and the CPU
    while every other run on the runner stalled (found by a review of hostile scratches)."""


class ArchiveRefused(ArchiveError, code="archive_refused"):
    """An archive that is not opened: not gzip, not a tar, over the cap, or a member that could
    land outside its destination (absolute, `..`, a link out) or is a device. `member` names the
    member when one is at fault."""

    def __init__(self, reason: str, *, member: str | None = None) -> None:
        self.reason = reason
        self.member = member
        where = f"member {member!r}: " if member is not None else ""
        super().__init__(f"archive refused: {where}{reason}")


@dataclass(slots=True)
class ArchiveStats:
    bytes: int
    """Size of the compressed archive file."""
    members: int
    """Members written, directories included (the root itself is not a member)."""
    raced: list[str] = field(default_factory=list)
    """Members (relative paths) that changed while they were read."""
    empty: bool = True
    """No member at all: the directory held nothing."""


class _GzipPipe:
    """One gzip stream whose deflate runs in worker threads while the caller builds the next
    chunk of the tar (zlib releases the GIL). Chunks are compressed pigz-style: each by its own
    compressor primed with the previous chunk's last 32 KiB and ended with a sync flush, so the
    output is one ordinary deflate stream in one gzip member — what `tar xzf`, `gzip -t` and
    Python's `gzip` open, byte for byte as if one compressor had made it. The cap is enforced
    on the compressed bytes as they are written."""

    def __init__(
        self,
        raw: BinaryIO,
        level: int,
        cap_bytes: int | None,
        plain_bound: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.raw = raw
        self.level = level
        self.cap_bytes = cap_bytes
        self.plain_bound = plain_bound
        self.stopped = stop or (lambda: False)
        self.written = 0
        self.buf = bytearray()
        self._crc = 0
        self.size = 0
        """Tar bytes shipped so far."""
        self._zdict = b""
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="runfleet-gzip")
        self._pending: deque[Future[bytes]] = deque()
        xfl = 4 if level == 1 else 2 if level == 9 else 0
        self._out(b"\x1f\x8b\x08\x00\x00\x00\x00\x00" + bytes((xfl, 255)))

    def _out(self, data: bytes) -> None:
        self.written += len(data)
        if self.cap_bytes is not None and self.written > self.cap_bytes:
            raise ArchiveOverCap(self.written, self.cap_bytes)
        self.raw.write(data)

    def _deflate(self, chunk: bytearray, zdict: bytes) -> bytes:
        args = (self.level, zlib.DEFLATED, -zlib.MAX_WBITS, zlib.DEF_MEM_LEVEL, 0)
        z = zlib.compressobj(*args, zdict) if zdict else zlib.compressobj(*args)
        return z.compress(chunk) + z.flush(zlib.Z_SYNC_FLUSH)

    def ship(self) -> None:
        """Hands the buffered tar bytes to a worker; writes what finished, in order."""
        chunk, self.buf = self.buf, bytearray()
        if not chunk:
            return
        self._crc = zlib.crc32(chunk, self._crc)
        self.size += len(chunk)
        if self.plain_bound is not None and self.size > self.plain_bound:
            raise ArchiveOverBound(self.size, self.plain_bound)
        if self.stopped():
            raise ArchiveStopped("the archive was stopped: its time ran out")
        self._pending.append(self._pool.submit(self._deflate, chunk, self._zdict))
        self._zdict = bytes(chunk[-32768:])
        while len(self._pending) > 2 * _WORKERS:
            self._out(self._pending.popleft().result())

    def close(self) -> None:
        self.ship()
        while self._pending:
            self._out(self._pending.popleft().result())
        self._out(zlib.compressobj(self.level, zlib.DEFLATED, -zlib.MAX_WBITS).flush())
        self._out(struct.pack("<II", self._crc & 0xFFFFFFFF, self.size & 0xFFFFFFFF))
        self._pool.shutdown()

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
        b.st_ctime_ns,
    )


_IDS = b"0000000\x00" * 2  # uid, gid 0
_TAIL = tarfile.GNU_MAGIC + bytes(255 - len(tarfile.GNU_MAGIC))  # uname .. padding, empty


def _header(name: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
    """The GNU tar header block(s) of one member, as `TarInfo.tobuf(GNU_FORMAT)` would write
    them (uid/gid 0, no user names). Built directly for the common case — a name and link of at
    most 100 bytes and numbers that fit in octal — because `tarfile`'s own header path costs
    more than the read of a small file; anything else goes through `tarfile`."""
    raw_name = name.encode("utf-8", "surrogateescape")
    raw_link = link.encode("utf-8", "surrogateescape")
    mode = stat.S_IMODE(st.st_mode)
    mtime = int(st.st_mtime)
    if len(raw_name) > 100 or len(raw_link) > 100 or size >= 8**11 or not 0 <= mtime < 8**11:
        info = tarfile.TarInfo(name)
        info.mode, info.mtime, info.size, info.type, info.linkname = mode, mtime, size, kind, link
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    head = b"".join(
        (raw_name.ljust(100, b"\x00"), b"%07o\x00" % mode, _IDS, b"%011o\x00" % size)
    ) + (b"%011o\x00" % mtime)
    rest = kind + raw_link.ljust(100, b"\x00") + _TAIL
    return head + (b"%06o\x00 " % (sum(head) + 256 + sum(rest))) + rest


def _read(fd: int, n: int) -> bytes:
    """One read of a member's bytes (a seam: the tests rewrite a file under it)."""
    return os.read(fd, n)


def _add_file(pipe: _GzipPipe, path: str, arcname: str, before: os.stat_result) -> bool:
    """Adds one regular file; True when it raced (changed between the stat before and after).
    Exactly the size its header promised is written: a file that shrank mid-read is padded with
    zeros (and raced), one that grew is cut (its stat after moved: raced)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return True
    try:
        opened = os.fstat(fd)
        size = opened.st_size
        pipe.buf += _header(arcname, opened, tarfile.REGTYPE, size)
        left, short = size, False
        while left:
            data = _read(fd, min(left, _CHUNK))
            if not data:
                short = True
                pipe.buf += bytes(left)
                break
            pipe.buf += data
            left -= len(data)
            if len(pipe.buf) >= _CHUNK:
                pipe.ship()
        pipe.buf += bytes(-size % tarfile.BLOCKSIZE)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    try:
        again = os.lstat(path)
    except FileNotFoundError:
        return True
    return short or not (_same(before, opened) and _same(opened, after) and _same(after, again))


def make_archive(
    src_dir: Path,
    dest: Path,
    *,
    level: int,
    cap_bytes: int | None = None,
    max_plain_bytes: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> ArchiveStats:
    """Writes `src_dir` as a gzip tar (at gzip `level`) to the file `dest`, members relative to
    `src_dir`, in sorted order. Regular files, directories and symlinks (not followed) are
    archived; devices, fifos and sockets are skipped. Raises `ArchiveOverCap` as soon as the
    compressed output passes `cap_bytes`, `ArchiveOverBound` as soon as the plain tar passes
    `max_plain_bytes`, and `ArchiveStopped` once `stop()` says so (looked at every MiB of tar
    and every member), removing `dest`. Blocking: run it in a thread."""
    if not 0 <= level <= 9:
        raise ValueError(f"gzip level must be 0..9, not {level}")
    stats = ArchiveStats(bytes=0, members=0)
    try:
        with open(dest, "wb", buffering=0) as raw:
            pipe = _GzipPipe(raw, level, cap_bytes, max_plain_bytes, stop)
            try:
                if src_dir.is_dir():  # a scratch never made is an empty one, as with `os.walk`
                    _walk(pipe, os.fspath(src_dir), "", stats)
                end = tarfile.BLOCKSIZE * 2  # two zero blocks, then up to a whole record
                total = pipe.size + len(pipe.buf) + end
                pipe.buf += bytes(end + -total % tarfile.RECORDSIZE)
                pipe.close()
            except BaseException:
                pipe.abort()
                raise
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    stats.bytes = dest.stat().st_size
    stats.empty = stats.members == 0
    return stats


def _walk(pipe: _GzipPipe, directory: str, prefix: str, stats: ArchiveStats) -> None:
    """One directory's entries in name order, then each subdirectory's (not following links)."""
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda e: e.name)
    subdirs = []
    for entry in entries:
        arcname = prefix + entry.name
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            stats.raced.append(arcname)
            continue
        if stat.S_ISREG(st.st_mode):
            if _add_file(pipe, entry.path, arcname, st):
                stats.raced.append(arcname)
        elif stat.S_ISDIR(st.st_mode):
            pipe.buf += _header(arcname + "/", st, tarfile.DIRTYPE)
            subdirs.append(entry)
        elif stat.S_ISLNK(st.st_mode):
            try:
                link = os.readlink(entry.path)
            except FileNotFoundError:
                stats.raced.append(arcname)
                continue
            refused = _link_refusal(arcname, link)
            if refused is not None:
                # What a restore refuses is not banked as if it would restore (found by a
                # review: a venv's absolute `bin/python3` link banked "fine", then every resume
                # was refused SCRATCH_NOT_PORTABLE). The bank records it unbankable, named.
                raise ArchiveRefused(
                    f"{refused} ({link}), which a restore refuses: make the link relative and"
                    " inside the scratch, or keep it out of the scratch",
                    member=arcname,
                )
            pipe.buf += _header(arcname, st, tarfile.SYMTYPE, link=link)
        else:
            continue
        stats.members += 1
        if len(pipe.buf) >= _CHUNK:
            pipe.ship()
        elif pipe.stopped():  # many small members make few chunks: look here too
            raise ArchiveStopped("the archive was stopped: its time ran out")
    for entry in subdirs:
        try:
            _walk(pipe, entry.path, prefix + entry.name + "/", stats)
        except FileNotFoundError:  # removed since it was listed
            stats.raced.append(prefix + entry.name)


def _refusal(member: tarfile.TarInfo) -> str | None:
    """Why a member may not be extracted, or None."""
    name = PurePosixPath(member.name)
    if member.name.startswith("/") or name.is_absolute():
        return "absolute path"
    if ".." in name.parts:
        return "path with '..'"
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        return "device, fifo or other special file"
    if member.issym():
        return _link_refusal(member.name, member.linkname)
    if member.islnk():
        return _target_refusal(PurePosixPath(member.linkname))
    return None


def _link_refusal(name: str, link: str) -> str | None:
    """Why a symlink `name` → `link` may not be in an archive (the bank and the restore ask
    the same question)."""
    target = PurePosixPath(link)
    if target.is_absolute():
        return "link to an absolute path"
    return _target_refusal(PurePosixPath(name).parent / target)


def _target_refusal(joined: PurePosixPath) -> str | None:
    depth = 0
    for part in joined.parts:
        depth += -1 if part == ".." else 0 if part in ("", ".") else 1
        if depth < 0:
            return "link out of the destination"
    return None


_CORRUPT = "not a readable gzip tar: corrupt: "
_TAR_READ = 64 * 1024
"""`tarfile`'s stream buffer in `check_archive`: it copies what is left of it at every header
read, so a larger one costs more than it saves (64 KiB: as fast as the seekable `r:gz` was)."""


class _VerifiedGunzip(io.RawIOBase):
    """The decompressed bytes of a gzip file, read in bounded pieces, every member's CRC-32 and
    length checked against its trailer as it ends (zlib does it with `wbits=31`): a stream that
    ends before its trailer, or whose trailer disagrees, is `ArchiveRefused`. Zero bytes after a
    member are padding and a new member may follow, as `gzip` reads them. It also notes where
    the last non-zero decompressed byte is, for the end-of-tar check in `check_archive`."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self.raw = raw
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.size = 0
        """Decompressed bytes handed out so far."""
        self.nonzero_end = 0
        """Offset just past the last non-zero decompressed byte so far."""
        self.ended = False

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        limit = n if n > 0 else _CHUNK
        while not self.ended:
            data = self._z.unconsumed_tail
            if not data and self._z.eof:  # a member ended, its trailer checked: another?
                data = self._z.unused_data.lstrip(b"\0")
                while not data:
                    more = self.raw.read(_CHUNK)
                    if not more:
                        self.ended = True
                        return b""
                    data = more.lstrip(b"\0")
                self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif not data:
                data = self.raw.read(_CHUNK)
                if not data:
                    raise ArchiveRefused(
                        f"{_CORRUPT}the gzip stream ends before its CRC and length"
                    )
            try:
                out = self._z.decompress(data, limit)
            except zlib.error as exc:  # a bad header, bad deflate data, CRC or length mismatch
                raise ArchiveRefused(f"{_CORRUPT}bad gzip data: {exc}") from exc
            if out:
                kept = len(out.rstrip(b"\0"))
                if kept:
                    self.nonzero_end = self.size + kept
                self.size += len(out)
                return out
        return b""


def check_archive(
    archive: Path, *, cap_bytes: int | None = None, max_plain_bytes: int | None = None
) -> None:
    """Checks, on the host and without extracting, that `archive` is a gzip tar within the cap
    whose every member would land inside its destination; `ArchiveRefused` otherwise.

    The whole stream is read, in constant memory: a gzip trailer (CRC-32, length) that is cut
    off or disagrees with the data is corruption, and so is a tar that stops before its end (a
    bad header after the first one ends `tarfile`'s walk quietly; here only zero blocks may
    follow the last member). With `max_plain_bytes`, a tar whose plain bytes pass it is refused
    before anything is written: a bank of sparse or zero-filled files is small and would fill
    the restoring runner's disk (found by a review of hostile scratches)."""
    try:
        size = archive.stat().st_size
        with open(archive, "rb") as f:
            magic = f.read(2)
    except FileNotFoundError as exc:
        raise ArchiveRefused("no such archive") from exc
    if cap_bytes is not None and size > cap_bytes:
        raise ArchiveRefused(f"{size} bytes, over the cap of {cap_bytes} bytes")
    if magic != b"\x1f\x8b":
        raise ArchiveRefused("not a gzip file")
    try:
        with open(archive, "rb") as raw:
            stream = _VerifiedGunzip(raw)
            with tarfile.open(fileobj=stream, mode="r|", bufsize=_TAR_READ) as tar:
                for member in tar:
                    reason = _refusal(member)
                    if reason is not None:
                        raise ArchiveRefused(reason, member=member.name)
                    _within(member.offset_data + member.size, max_plain_bytes)  # its end
                stop = tar.offset
            while stream.read(_CHUNK):  # to the last trailer
                _within(stream.size, max_plain_bytes)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveRefused(f"not a readable gzip tar: {exc}") from exc
    if not stream.nonzero_end <= stop <= stream.size:
        raise ArchiveRefused(
            f"{_CORRUPT}the tar's members stop at byte {stop} of {stream.size} "
            "(a bad header, or data cut short), not at its end"
        )


_DETERMINISTIC = frozenset(
    {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL}
)
"""Errors a member meets on every try (a crafted archive: a file where a link was made): the
archive is refused, the run held, not retried as transient (found by a review)."""


def _within(plain: int, bound: int | None) -> None:
    if bound is not None and plain > bound:
        raise ArchiveRefused(
            f"its plain tar holds over {bound} bytes (RUNFLEET_SCRATCH_MAX_UNCOMPRESSED)"
        )


def safe_extract(
    archive: Path,
    dest_dir: Path,
    *,
    cap_bytes: int | None = None,
    max_plain_bytes: int | None = None,
) -> int:
    """Checks `archive` (`check_archive`), then extracts it into `dest_dir` (created) with the
    `data` filter as a second fence; returns the bytes of the regular files written.
    `ArchiveRefused` for anything `check_archive` refuses or the filter stops, and for a member
    that cannot be written where the check put it (a path that turns out taken, a name the
    filesystem refuses): the same archive fails the same way on every try. Blocking."""
    check_archive(archive, cap_bytes=cap_bytes, max_plain_bytes=max_plain_bytes)
    dest_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                try:
                    tar.extract(member, dest_dir, filter="data")
                except OSError as exc:
                    if exc.errno not in _DETERMINISTIC:
                        raise  # the disk (full, gone): worth another try
                    raise ArchiveRefused(
                        f"cannot be written: {exc.strerror}", member=member.name
                    ) from exc
                if member.isreg():
                    total += member.size
    except tarfile.FilterError as exc:
        raise ArchiveRefused(
            str(exc), member=getattr(exc, "tarinfo", None) and exc.tarinfo.name
        ) from exc
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveRefused(f"not a readable gzip tar: {exc}") from exc
    return total
