"""A launch's publication record, written a moment later and only where a claim has not
written it already (SPEC §4 Launch, §5.3; issue 19).

A launch answers once its publish is acknowledged; the record of which copy carries the run is
written after, without the producer waiting (ADR-0014, amendment 3). Written at once, it is a
second write of every row, about a fifth of a launch's CPU, and a write-lock turn that competes
with the runners'. Yet when runners keep up, one has usually claimed the run before the record would
land, and the claim writes the whole `publication` itself, so the record's CAS is refused.

So each record waits `delay_s`, then one read per batch (`list_run_copies` by run id) finds the
runs still without their record, and only those are written, through the same CAS as before.
Skipping after the read is exactly the case the CAS would refuse, so the outcome is the same as
writing every record; only the cost changes. A record never written (the producer dies in the
delay) is the case the sweeper's missing-publication rule repairs (SPEC §5.7), 60 s after the
launch, with the original `Nats-Msg-Id` that the dedupe window answers as this very copy; the
protocol model's `launch_record` rule explores it. `flush()` writes what is pending now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from nats.js.api import PubAck

from store import RunDocument, RunQuery, RunStore

log = logging.getLogger(__name__)

RECORD_DELAY_S = 1.0
"""How long a record waits for a claim to make it unneeded: well past a run's claim when the
fleet keeps up (milliseconds), far inside the sweeper's 60 s missing-publication grace."""

BATCH = 500
"""Records looked up in one read (one `IN (...)` of run ids)."""

GATHER = 0.25
"""A pass takes the records due within this fraction of `delay_s` too, so the writer wakes a
few times per delay, not once per launch (a wake per launch cost a third of the saving)."""

WriteRecord = Callable[[RunDocument, PubAck, datetime], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class PendingRecord:
    due: float
    """The event loop's clock (`loop.time()`) when the record is looked at."""
    doc: RunDocument
    ack: PubAck
    at: datetime


class LaunchRecords:
    """The records a publisher's launches left to write, oldest first."""

    def __init__(self, store: RunStore, write: WriteRecord, delay_s: float = RECORD_DELAY_S):
        self.store = store
        self.write = write
        self.delay_s = delay_s
        self._pending: deque[PendingRecord] = deque()
        self._task: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()
        self._flushes = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, doc: RunDocument, ack: PubAck, at: datetime) -> None:
        loop = asyncio.get_running_loop()
        self._pending.append(PendingRecord(loop.time() + self.delay_s, doc, ack, at))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._write_when_due())

    async def flush(self) -> None:
        """Write every pending record now, and wait for them (before the store closes)."""
        self._flushes += 1
        self._hurry.set()
        try:
            while self._task is not None and not self._task.done():
                # Shielded: a cancelled flush leaves the records to the task, not half-written.
                await asyncio.shield(self._task)
        finally:
            self._flushes -= 1
            if not self._flushes:  # another flush still waiting keeps the hurry on
                self._hurry.clear()

    async def _write_when_due(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            wait = self._pending[0].due - loop.time()
            if wait > 0 and not self._hurry.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), wait)
                continue
            until, batch = loop.time() + GATHER * self.delay_s, list[PendingRecord]()
            while self._pending and len(batch) < BATCH:
                if self._pending[0].due > until and not self._hurry.is_set():
                    break
                batch.append(self._pending.popleft())
            await self.write_needed(batch)

    async def write_needed(self, batch: Sequence[PendingRecord]) -> int:
        """Write the records of `batch` that no claim has made unneeded; the number written.
        A failure is logged, never raised: the sweeper writes what is missed (module doc)."""
        by_id = {p.doc.run_id: p for p in batch}
        try:
            page = await self.store.list_run_copies(RunQuery(run_ids=list(by_id), limit=len(by_id)))
        except Exception as exc:  # noqa: BLE001 - the sweeper records them (module doc)
            log.warning(
                "%d publication records not written (%r); the sweeper repairs them",
                len(by_id),
                exc,
            )
            return 0
        needed = [
            by_id[copy.run_id]
            for copy in page.copies
            # What the record's CAS requires: the same attempt, its copy not yet recorded.
            if copy.attempt == by_id[copy.run_id].doc.attempt
            and copy.stream_seq != by_id[copy.run_id].ack.seq
        ]
        results = await asyncio.gather(
            *(self.write(p.doc, p.ack, p.at) for p in needed), return_exceptions=True
        )
        for p, result in zip(needed, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "run %s: publication record not written (%r); the sweeper repairs it",
                    p.doc.run_id,
                    result,
                )
        return len(needed)
