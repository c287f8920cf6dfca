"""A full disk or a read-only store is unavailable infrastructure with a remedy, not a store
fault (a disk-full drill: `error [store_error]`, exit 1, no remedy line, from `gc`, `upload`,
`launch` and `resume`). SQLite's own errors, made for real: a database capped by
`max_page_count` answers SQLITE_FULL exactly as a full disk does; a read-only open answers
SQLITE_READONLY."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest

from runner.cli.errors import EXIT_UNREACHABLE, exit_code_for
from store.blobs_fs import local_errors
from store.errors import StoreUnavailable
from store.sqlite.schema import translate


def _full(path: Path) -> sqlite3.Error:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (x BLOB)")
    db.commit()
    db.execute("PRAGMA max_page_count = 3")
    try:
        db.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    except sqlite3.Error as exc:
        return exc
    finally:
        db.close()
    raise AssertionError("the capped database took the row")


def _read_only(path: Path) -> sqlite3.Error:
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        db.execute("INSERT INTO t VALUES (1)")
    except sqlite3.Error as exc:
        return exc
    finally:
        db.close()
    raise AssertionError("the read-only database took the row")


@pytest.mark.parametrize(
    ("make", "said"),
    [(_full, "free space on the disk holding"), (_read_only, "writable")],
    ids=["disk-full", "read-only"],
)
def test_a_full_disk_or_a_read_only_store_is_unavailable_with_a_remedy(
    tmp_path: Path, make: object, said: str
) -> None:
    path = tmp_path / "runs.db"
    exc = make(path)  # type: ignore[operator]

    error = translate(exc, path)

    assert isinstance(error, StoreUnavailable)
    assert error.remedy is not None and said in error.remedy
    assert exit_code_for(error) == EXIT_UNREACHABLE


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_a_blob_write_on_a_full_or_read_only_disk_is_unavailable_with_a_remedy(code: int) -> None:
    with pytest.raises(StoreUnavailable) as caught, local_errors("cannot write blob k"):
        raise OSError(code, os.strerror(code))
    assert caught.value.remedy is not None and "disk" in caught.value.remedy
    assert exit_code_for(caught.value) == EXIT_UNREACHABLE


FAILED_PUT = """
import asyncio, resource, signal, sys
from pathlib import Path
from store.blobs_fs import FilesystemBlobStore
from store.errors import StoreError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails EFBIG instead
root = Path(sys.argv[1])
src = root.parent / "src"
src.write_bytes(b"x" * 100_000)
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))

async def main() -> None:
    blobs = FilesystemBlobStore(root)
    for how, key in (("bytes", "uploads/u1/data"), ("file", "uploads/u2/a/data")):
        try:
            if how == "bytes":
                await blobs.put_bytes(key, b"x" * 100_000)
            else:
                await blobs.put_file(key, src)
        except StoreError as exc:
            print("refused", how, exc)
        else:
            print("landed", how)
    await blobs.close()

asyncio.run(main())
"""


def test_a_blob_write_that_fails_leaves_no_directory_it_made(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "blobs"
    (root / "uploads" / "kept").mkdir(parents=True)  # a directory a write did not make stays
    done = subprocess.run(
        [sys.executable, "-c", FAILED_PUT, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused") == 2, done.stdout  # the writes really failed
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "uploads",
        "uploads/kept",
    ]
