"""The WAL is copied back into the database file by a thread of its own (issue 19,
`store.sqlite.checkpointer`), not inside a commit: writes never wait for a checkpoint until
the backstop mark, ≈ 80 MB of WAL."""

from __future__ import annotations

from pathlib import Path

from store.sqlite import SqliteRunStore
from store.sqlite.checkpointer import BACKSTOP_PAGES
from tests.runner.conftest import eventually
from tests.store.conftest import MakeRun


async def test_the_wal_is_checkpointed_in_the_background_while_the_store_is_open(
    tmp_path: Path, make_run: MakeRun
) -> None:
    path = tmp_path / "runs.db"
    store = await SqliteRunStore.open(path)
    try:
        checkpointer = store.checkpointer
        assert checkpointer is not None
        before = path.stat().st_size
        for _ in range(300):  # ≈ 1 MB of WAL: far below any automatic checkpoint's mark
            await store.create_run(make_run())

        # The rows reach the database file itself while the store stays open, copied by the
        # checkpointer (whose count moves just after the pass that grew the file: both are
        # awaited, or the test reads the count between the two).
        async def grown() -> bool:
            return path.stat().st_size > before + 256 * 1024 and checkpointer.checkpoints >= 1

        await eventually(grown, within=10.0)
        # The writers' own automatic checkpoint is only the backstop.
        mark = await store._read(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone())
        assert mark == (BACKSTOP_PAGES,)
    finally:
        await store.close()
    assert store.checkpointer is None  # stopped with the store
