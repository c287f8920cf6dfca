"""The one archive module: every tar runfleet makes or opens goes through here (STYLE.md).

The scratch bank (SPEC §7.3), its restore (§7.4) and attachments (§8) all need the same two
things, and each is easy to get subtly wrong in its own copy:

- *making* a gzip tar of a directory that something may still be writing to. Python's `tarfile`
  does not notice a file changing under it (and raises half-way through a member when one
  shrinks, leaving a broken stream), so every regular file is stat'ed before and after it is
  read; a member whose size, mtime, ctime or inode moved is named in `ArchiveStats.raced` and a
  caller may tar again. A short read is padded to the size the header promised, so the archive
  stays well-formed whatever happened to the file. The gzip level is always explicit (level 1
  is about 2.5 times faster than `tar czf`'s default 6 on mixed trees; see adr/0011).
- *opening* an archive someone else made: gzip and tar structure, no absolute member, no `..`,
  no link that points out of the destination, no device, fifo or socket, and a cap — all
  checked on the host before a single byte is written (`check_archive`), then extracted with
  the standard library's `data` filter as a second fence (`safe_extract`).

Both take a `cap_bytes` on the *compressed* archive: that is what is stored and moved.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import zlib
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


class ArchiveError(RunfleetError, code="archive_error"):
    """An archive could not be made or opened."""


class ArchiveOverCap(ArchiveError, code="archive_over_cap"):
    """The compressed archive grew past its cap while being made; nothing usable was written."""

    def __init__(self, written: int, cap_bytes: int) -> None:
        self.written = written
        self.cap_bytes = cap_bytes
        super().__init__(f"archive reached {written} bytes, over its cap of {cap_bytes} bytes")


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


class _Counting:
    """A write-only file object that counts what passes and enforces the cap as it goes."""

    def __init__(self, raw: BinaryIO, cap_bytes: int | None) -> None:
        self.raw = raw
        self.cap_bytes = cap_bytes
        self.written = 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        if self.cap_bytes is not None and self.written > self.cap_bytes:
            raise ArchiveOverCap(self.written, self.cap_bytes)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


class _Exactly:
    """Reads exactly `size` bytes from `f`: a file that shrank mid-read is padded with zeros
    (and flagged), a file that grew is cut at the size its header already promised."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.left = size
        self.short = False

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.f.read(want) if want else b""
        if len(data) < want:
            self.short = True
            data += b"\0" * (want - len(data))
        self.left -= len(data)
        return data


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
        b.st_ctime_ns,
    )


def _info(arcname: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(arcname)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_file(tar: tarfile.TarFile, path: Path, arcname: str, before: os.stat_result) -> bool:
    """Adds one regular file; True when it raced (changed between the stat before and after)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return True
    with os.fdopen(fd, "rb") as f:
        opened = os.fstat(fd)
        info = _info(arcname, opened)
        info.size = opened.st_size
        reader = _Exactly(f, info.size)
        tar.addfile(info, reader)
        after = os.fstat(fd)
    try:
        again = os.lstat(path)
    except FileNotFoundError:
        return True
    return reader.short or not (
        _same(before, opened) and _same(opened, after) and _same(after, again)
    )


def make_archive(
    src_dir: Path, dest: Path, *, level: int, cap_bytes: int | None = None
) -> ArchiveStats:
    """Writes `src_dir` as a gzip tar (at gzip `level`) to the file `dest`, members relative to
    `src_dir`, in sorted order. Regular files, directories and symlinks (not followed) are
    archived; devices, fifos and sockets are skipped. Raises `ArchiveOverCap` as soon as the
    compressed output passes `cap_bytes` (and removes `dest`). Blocking: run it in a thread."""
    if not 0 <= level <= 9:
        raise ValueError(f"gzip level must be 0..9, not {level}")
    stats = ArchiveStats(bytes=0, members=0)
    try:
        with open(dest, "wb") as raw:
            counting = _Counting(raw, cap_bytes)
            with (
                gzip.GzipFile(
                    filename="",
                    mode="wb",
                    fileobj=counting,
                    compresslevel=level,
                    mtime=0,
                ) as gz,
                io.BufferedWriter(gz, _CHUNK) as buffered,  # few, large compress() calls
                tarfile.open(fileobj=buffered, mode="w", format=tarfile.GNU_FORMAT) as tar,
            ):
                tar.copybufsize = _CHUNK  # type: ignore[attr-defined]
                _walk(tar, src_dir, stats)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    stats.bytes = dest.stat().st_size
    if cap_bytes is not None and stats.bytes > cap_bytes:
        dest.unlink(missing_ok=True)
        raise ArchiveOverCap(stats.bytes, cap_bytes)
    stats.empty = stats.members == 0
    return stats


def _walk(tar: tarfile.TarFile, src_dir: Path, stats: ArchiveStats) -> None:
    for root, dirs, files in os.walk(src_dir):
        dirs.sort()
        base = Path(root)
        for name in [*dirs, *sorted(files)]:
            path = base / name
            arcname = path.relative_to(src_dir).as_posix()
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                stats.raced.append(arcname)
                continue
            if stat.S_ISREG(st.st_mode):
                if _add_file(tar, path, arcname, st):
                    stats.raced.append(arcname)
            elif stat.S_ISDIR(st.st_mode):
                info = _info(arcname, st)
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info = _info(arcname, st)
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                tar.addfile(info)
                if name in dirs:  # os.walk lists a link to a directory among dirs: not followed
                    dirs.remove(name)
            else:
                continue
            stats.members += 1


def _refusal(member: tarfile.TarInfo) -> str | None:
    """Why a member may not be extracted, or None."""
    name = PurePosixPath(member.name)
    if member.name.startswith("/") or name.is_absolute():
        return "absolute path"
    if ".." in name.parts:
        return "path with '..'"
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        return "device, fifo or other special file"
    if member.issym() or member.islnk():
        target = PurePosixPath(member.linkname)
        if target.is_absolute():
            return "link to an absolute path"
        joined = (name.parent / target) if member.issym() else target
        depth = 0
        for part in joined.parts:
            depth += -1 if part == ".." else 0 if part in ("", ".") else 1
            if depth < 0:
                return "link out of the destination"
    return None


def check_archive(archive: Path, *, cap_bytes: int | None = None) -> None:
    """Checks, on the host and without extracting, that `archive` is a gzip tar within the cap
    whose every member would land inside its destination; `ArchiveRefused` otherwise."""
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
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                reason = _refusal(member)
                if reason is not None:
                    raise ArchiveRefused(reason, member=member.name)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveRefused(f"not a readable gzip tar: {exc}") from exc


def safe_extract(archive: Path, dest_dir: Path, *, cap_bytes: int | None = None) -> int:
    """Checks `archive` (`check_archive`), then extracts it into `dest_dir` (created) with the
    `data` filter as a second fence; returns the bytes of the regular files written.
    `ArchiveRefused` for anything `check_archive` refuses or the filter stops. Blocking."""
    check_archive(archive, cap_bytes=cap_bytes)
    dest_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                tar.extract(member, dest_dir, filter="data")
                if member.isreg():
                    total += member.size
    except tarfile.FilterError as exc:
        raise ArchiveRefused(
            str(exc), member=getattr(exc, "tarinfo", None) and exc.tarinfo.name
        ) from exc
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveRefused(f"not a readable gzip tar: {exc}") from exc
    return total
