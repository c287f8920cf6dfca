"""`WalCheckpointer`: copy the WAL back into the database file on a thread of its own, off the
commit path.

SQLite's default checkpoint runs inside the commit that pushes the WAL past 1 000 pages: that
commit, and every write of its group (ADR-0009), waits while ≈ 4 MB are copied and the file is
synced. At a thousand runs a second the WAL passes that mark a few times a second, and those
waits were the tail of publish → finished at 50 % load (issue 19). Here a thread with its own
connection runs `PRAGMA wal_checkpoint(PASSIVE)` every `interval`: a passive checkpoint waits
for no reader or writer, and the writers' own automatic checkpoint stays on at a far higher mark
(`BACKSTOP_PAGES`) only as a backstop, should this thread fall behind or die. ADR-0009
amendment 2 has the measurement.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 0.1
BACKSTOP_PAGES = 20_000
"""The writers' automatic checkpoint (`PRAGMA wal_autocheckpoint`), ≈ 80 MB of WAL: only if
the background checkpoints stop keeping up."""


class WalCheckpointer:
    def __init__(
        self, connect: Callable[[], sqlite3.Connection], name: str, interval: float = INTERVAL_S
    ) -> None:
        self._connect = connect
        self._interval = interval
        self._stop = threading.Event()
        self.checkpoints = 0
        """Passes that copied at least one frame (for tests and curiosity)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            conn = self._connect()
        except sqlite3.Error as exc:  # the writers' own checkpoint still runs (the backstop)
            log.warning("WAL checkpointer not started: %s", exc)
            return
        try:
            conn.execute("PRAGMA busy_timeout = 0")
            while not self._stop.wait(self._interval):
                try:
                    row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.OperationalError:
                    continue  # another process is checkpointing: its pass is as good as ours
                if row is not None and row[2] > 0:
                    self.checkpoints += 1
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
