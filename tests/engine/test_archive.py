"""engine/archive.py: the one module that makes and opens tars (explicit level, stat before and
after, safe extraction)."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import threading
import zlib
from pathlib import Path

import pytest

from engine.archive import (
    ArchiveOverBound,
    ArchiveOverCap,
    ArchiveRefused,
    ArchiveStopped,
    check_archive,
    make_archive,
    safe_extract,
)


def _tree(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "->" + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_bytes()
        else:
            out[rel] = "dir"
    return out


def _evil(tmp_path: Path, *members: tarfile.TarInfo) -> Path:
    archive = tmp_path / "evil.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
    return archive


def _member(name: str, *, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = 1 if kind == tarfile.REGTYPE else 0
    return info


def test_a_directory_round_trips_byte_for_byte_with_links_not_followed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "data.bin").write_bytes(os.urandom(200_000))
    (src / "verify.sh").write_text("#!/bin/sh\nexit 0\n")
    (src / "verify.sh").chmod(0o755)
    (src / "empty").mkdir()
    (src / "link").symlink_to("a/b/data.bin")
    stats = make_archive(src, tmp_path / "out.tgz", level=1)
    assert stats.members == 6 and not stats.empty and stats.raced == []
    assert stats.bytes == (tmp_path / "out.tgz").stat().st_size
    dest = tmp_path / "dest"
    written = safe_extract(tmp_path / "out.tgz", dest)
    assert _tree(dest) == _tree(src)
    assert written == 200_000 + len("#!/bin/sh\nexit 0\n")
    assert os.access(dest / "verify.sh", os.X_OK)


def test_an_empty_directory_is_an_empty_archive(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    stats = make_archive(tmp_path / "src", tmp_path / "out.tgz", level=1)
    assert stats.empty and stats.members == 0
    check_archive(tmp_path / "out.tgz")


def test_the_gzip_level_is_the_one_given(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "text").write_bytes(b"".join(b"line %d of some text\n" % i for i in range(200_000)))
    fast = make_archive(src, tmp_path / "l1.tgz", level=1).bytes
    small = make_archive(src, tmp_path / "l9.tgz", level=9).bytes
    assert small < fast
    with pytest.raises(ValueError):
        make_archive(src, tmp_path / "bad.tgz", level=10)


def test_over_the_cap_raises_and_leaves_no_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "noise").write_bytes(os.urandom(300_000))
    with pytest.raises(ArchiveOverCap) as caught:
        make_archive(src, tmp_path / "out.tgz", level=1, cap_bytes=100_000)
    assert caught.value.cap_bytes == 100_000 and caught.value.code == "archive_over_cap"
    assert not (tmp_path / "out.tgz").exists()


@pytest.mark.parametrize(
    ("rewrite_to", "why"),
    [(3 << 20, "shrank: the short read is padded"), (12 << 20, "grew: the read is cut")],
)
def test_a_file_rewritten_during_the_read_is_named_raced_and_the_archive_stays_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewrite_to: int, why: str
) -> None:
    """The writer is made to strike between the open and the first read, through the module's
    read seam: a thread racing the tar was a coin toss on a loaded 2-core CI machine."""
    import engine.archive

    src = tmp_path / "src"
    src.mkdir()
    (src / "calm.txt").write_bytes(b"calm")
    target = src / "busy.bin"
    target.write_bytes(b"\0" * (8 << 20))
    real_read = engine.archive._read
    struck = threading.Event()

    def read_while_rewritten(fd: int, n: int) -> bytes:
        if not struck.is_set() and os.fstat(fd).st_ino == target.stat().st_ino:
            struck.set()
            with target.open("r+b") as f:  # same inode, new size: what a busy writer does
                f.truncate(rewrite_to)
        return real_read(fd, n)

    monkeypatch.setattr(engine.archive, "_read", read_while_rewritten)
    stats = make_archive(src, tmp_path / "out.tgz", level=1)

    assert struck.is_set()
    assert stats.raced == ["busy.bin"], why
    check_archive(tmp_path / "out.tgz")  # well-formed whatever the file did
    with tarfile.open(tmp_path / "out.tgz", "r:gz") as tar:
        member = tar.getmember("busy.bin")
        assert member.size == 8 << 20  # exactly what the header promised
        calm = tar.extractfile("calm.txt")
        assert calm is not None and calm.read() == b"calm"


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (_member("../x"), "'..'"),
        (_member("a/../../x"), "'..'"),
        (_member("/etc/passwd"), "absolute"),
        (_member("dev", kind=tarfile.CHRTYPE), "device"),
        (_member("fifo", kind=tarfile.FIFOTYPE), "device"),
        (_member("up", kind=tarfile.SYMTYPE, link="../../etc"), "link out"),
        (_member("abs", kind=tarfile.SYMTYPE, link="/etc/passwd"), "absolute"),
        (_member("hard", kind=tarfile.LNKTYPE, link="../outside"), "link out"),
    ],
)
def test_a_member_that_could_land_outside_is_refused_before_anything_is_written(
    tmp_path: Path, member: tarfile.TarInfo, reason: str
) -> None:
    archive = _evil(tmp_path, _member("fine"), member)
    with pytest.raises(ArchiveRefused, match=reason) as caught:
        safe_extract(archive, tmp_path / "dest")
    assert caught.value.member == member.name
    assert not (tmp_path / "dest").exists()


def test_not_gzip_truncated_or_over_the_cap_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:
        tar.addfile(_member("a"), io.BytesIO(b"x"))
    with pytest.raises(ArchiveRefused, match="not a gzip"):
        check_archive(plain)
    src = tmp_path / "src"
    src.mkdir()
    (src / "noise").write_bytes(os.urandom(100_000))
    whole = tmp_path / "whole.tgz"
    make_archive(src, whole, level=1)
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(whole.read_bytes()[:50_000])
    with pytest.raises(ArchiveRefused, match="readable"):
        check_archive(cut)
    with pytest.raises(ArchiveRefused, match="over the cap"):
        check_archive(whole, cap_bytes=1000)
    with pytest.raises(ArchiveRefused, match="no such"):
        check_archive(tmp_path / "gone.tgz")
    junk = tmp_path / "junk.tgz"
    junk.write_bytes(gzip.compress(b"not a tar at all" * 100))
    with pytest.raises(ArchiveRefused):
        check_archive(junk)


def test_headers_are_what_tarfile_writes_for_short_long_and_non_ascii_names(tmp_path: Path) -> None:
    from engine.archive import _header

    (tmp_path / "f").write_bytes(b"x")
    st = os.lstat(tmp_path / "f")
    for name, kind, link in [
        ("a/b.txt", tarfile.REGTYPE, ""),
        ("d" * 99 + "/", tarfile.DIRTYPE, ""),
        ("n" * 100, tarfile.REGTYPE, ""),
        ("long/" * 40 + "name", tarfile.REGTYPE, ""),
        ("caf\u00e9/\udcff", tarfile.SYMTYPE, "t" * 150),
    ]:
        info = tarfile.TarInfo(name)
        info.mode, info.mtime, info.type, info.linkname = (
            st.st_mode & 0o7777,
            int(st.st_mtime),
            kind,
            link,
        )
        info.size = 1 if kind == tarfile.REGTYPE else 0
        info.uname = info.gname = ""
        want = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
        assert _header(name, st, kind, info.size, link) == want, name


def test_an_archive_of_a_deep_tree_opens_with_tar_xzf_as_one_gzip_member(tmp_path: Path) -> None:
    import subprocess

    src = tmp_path / "src"
    deep = src / ("segment-" * 12) / "x" / ("y" * 120)
    deep.mkdir(parents=True)
    for i in range(40):  # several compressor chunks: the pigz-style joins are exercised
        (deep / f"f{i}.bin").write_bytes(os.urandom(50_000) + bytes(100_000))
    (src / "caf\u00e9.txt").write_text("non-ascii name")
    (src / ("l" * 130)).symlink_to("x" * 120)
    make_archive(src, tmp_path / "out.tgz", level=1)
    data = (tmp_path / "out.tgz").read_bytes()
    dec = zlib.decompressobj(31)  # gzip wrapping
    assert dec.decompress(data)
    assert dec.eof and dec.unused_data == b""  # one member, nothing after it
    dest = tmp_path / "dest"
    dest.mkdir()
    subprocess.run(["tar", "xzf", str(tmp_path / "out.tgz"), "-C", str(dest)], check=True)
    assert _tree(dest) == _tree(src)


def test_a_directory_that_does_not_exist_is_an_empty_archive(tmp_path: Path) -> None:
    stats = make_archive(tmp_path / "never-made", tmp_path / "out.tgz", level=1)
    assert stats.empty and stats.members == 0
    check_archive(tmp_path / "out.tgz")


def _bank_of_five(tmp_path: Path) -> tuple[Path, Path]:
    """A bank of five incompressible 2000-byte files (stored, not deflated: a flipped byte
    changes data, not the deflate structure) and its source directory."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.bin").write_bytes(os.urandom(2000))
    archive = tmp_path / "bank.tgz"
    make_archive(src, archive, level=1)
    return src, archive


@pytest.mark.parametrize("where", [-8, -5, -4, -1], ids=["crc", "crc-high", "length", "len-high"])
def test_a_bank_whose_gzip_trailer_is_corrupt_is_refused_as_corrupt(
    tmp_path: Path, where: int
) -> None:
    _, archive = _bank_of_five(tmp_path)
    data = bytearray(archive.read_bytes())
    data[where] ^= 0xFF
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArchiveRefused, match="corrupt"):
        check_archive(bad)
    with pytest.raises(ArchiveRefused, match="corrupt"):
        safe_extract(bad, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("cut", [1, 4, 8])
def test_a_bank_whose_gzip_trailer_is_cut_off_is_refused_as_corrupt(
    tmp_path: Path, cut: int
) -> None:
    _, archive = _bank_of_five(tmp_path)
    bad = tmp_path / "cut.tgz"
    bad.write_bytes(archive.read_bytes()[:-cut])
    with pytest.raises(ArchiveRefused, match="corrupt"):
        check_archive(bad)


def test_a_bad_tar_header_after_the_first_is_refused_not_read_as_a_shorter_archive(
    tmp_path: Path,
) -> None:
    _, archive = _bank_of_five(tmp_path)
    raw = bytearray(gzip.decompress(archive.read_bytes()))
    second = 512 + 2048  # the first member's header and its data, padded to whole blocks
    raw[second + 148 : second + 156] = b"0000000\x00"  # the second header's checksum, wrong
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(gzip.compress(bytes(raw)))  # a sound gzip stream of a broken tar
    with pytest.raises(ArchiveRefused, match="corrupt"):
        check_archive(bad)
    with pytest.raises(ArchiveRefused, match="corrupt"):
        safe_extract(bad, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()  # not one file of the five written


def test_a_tar_whose_last_member_is_cut_short_is_refused(tmp_path: Path) -> None:
    _, archive = _bank_of_five(tmp_path)
    raw = gzip.decompress(archive.read_bytes())
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(gzip.compress(raw[: 4 * 2560 + 512 + 1000]))  # inside the fifth file's data
    with pytest.raises(ArchiveRefused):
        check_archive(cut)


def test_a_flipped_byte_anywhere_in_a_bank_is_refused_never_restored_silently_wrong(
    tmp_path: Path,
) -> None:
    src, archive = _bank_of_five(tmp_path)
    good = archive.read_bytes()
    want = {p.name: p.read_bytes() for p in src.iterdir()}
    for pos in range(10, len(good), 11):  # past the 10-byte gzip header, to the trailer's end
        data = bytearray(good)
        data[pos] ^= 0x01
        bad = tmp_path / "flip.tgz"
        bad.write_bytes(bytes(data))
        dest = tmp_path / f"out-{pos}"
        try:
            safe_extract(bad, dest)
        except ArchiveRefused:
            continue
        got = {p.name: p.read_bytes() for p in dest.iterdir()}
        assert got == want, f"a flip at byte {pos} restored silently wrong"


def test_a_gzip_padded_with_zeros_or_in_two_members_still_opens_whole(tmp_path: Path) -> None:
    src, archive = _bank_of_five(tmp_path)
    raw = gzip.decompress(archive.read_bytes())
    half = 3 * 2560
    for name, data in {
        "padded.tgz": archive.read_bytes() + bytes(1024),
        "two.tgz": gzip.compress(raw[:half]) + gzip.compress(raw[half:]),
    }.items():
        path = tmp_path / name
        path.write_bytes(data)
        dest = tmp_path / f"out-{name}"
        assert safe_extract(path, dest) == 5 * 2000
        assert _tree(dest) == _tree(src)


def test_a_bank_looks_at_its_stop_and_its_plain_bound_as_it_reads(tmp_path: Path) -> None:
    """A thread cannot be cancelled: a bank past its budget went on reading a 100 GiB sparse
    file for minutes, stalling every run on the runner, and the compressed cap let it read
    ~58 GiB first (a review of hostile scratches). The writer stops when told, and at the
    plain bound; it leaves no file either way."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as f:
        f.truncate(64 * 1024 * 1024 * 1024)  # 64 GiB of holes: no disk, all zeros to read
    out = tmp_path / "out.tgz"
    asked = threading.Event()

    def stop() -> bool:
        asked.set()
        return True

    with pytest.raises(ArchiveStopped):
        make_archive(src, out, level=1, stop=stop)
    assert asked.is_set() and not out.exists()
    with pytest.raises(ArchiveOverBound) as over:
        make_archive(src, out, level=1, max_plain_bytes=8 * 1024 * 1024)
    assert over.value.plain <= 8 * 1024 * 1024 + 2 * 1024 * 1024 and not out.exists()


def test_a_bank_refuses_a_link_no_restore_would_take_naming_it(tmp_path: Path) -> None:
    """A venv's `bin/python3 -> /usr/bin/python3` banked "fine", then every resume was refused
    SCRATCH_NOT_PORTABLE (a review): the bank refuses it itself, naming the member."""
    for name, link in (("v/bin/python3", "/usr/bin/python3"), ("up", "..")):
        src = tmp_path / name.replace("/", "_") / "src"
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).symlink_to(link)
        with pytest.raises(ArchiveRefused) as refused:
            make_archive(src, tmp_path / "out.tgz", level=1)
        assert refused.value.member == name and "a restore refuses" in refused.value.message
    # A relative link inside the scratch banks and restores as before.
    ok = tmp_path / "ok"
    (ok / "a").mkdir(parents=True)
    (ok / "a" / "f").write_text("x")
    (ok / "link").symlink_to("a/f")
    make_archive(ok, tmp_path / "ok.tgz", level=1)
    safe_extract(tmp_path / "ok.tgz", tmp_path / "ok-dest")
    assert os.readlink(tmp_path / "ok-dest" / "link") == "a/f"


def test_a_restore_refuses_a_plain_tar_over_its_bound_before_writing(tmp_path: Path) -> None:
    """A 2 GiB sparse file banks as ~9 MB and wrote 2.1 GB on the restoring runner (a review):
    the restore reads the plain size first and refuses past the bound."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "zeros").write_bytes(bytes(4 * 1024 * 1024))
    make_archive(src, tmp_path / "bank.tgz", level=1)
    with pytest.raises(ArchiveRefused, match="RUNFLEET_SCRATCH_MAX_UNCOMPRESSED"):
        safe_extract(tmp_path / "bank.tgz", tmp_path / "dest", max_plain_bytes=1024 * 1024)
    assert not (tmp_path / "dest").exists()
    assert safe_extract(tmp_path / "bank.tgz", tmp_path / "dest2", max_plain_bytes=8 << 20)


def test_a_member_that_cannot_be_written_where_it_was_checked_is_refused_not_retried(
    tmp_path: Path,
) -> None:
    """A link `d -> sub`, then a file `d/f`: the check passes, the write meets EEXIST on every
    try, and was retried as a transient read failure into the DLQ (a review). Refused."""
    archive = _evil(tmp_path, _member("d", kind=tarfile.SYMTYPE, link="sub"), _member("d/f"))
    with pytest.raises(ArchiveRefused, match="cannot be written") as refused:
        safe_extract(archive, tmp_path / "dest")
    assert refused.value.member == "d/f"
