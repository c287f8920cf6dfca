"""The checks made while the runs flow, which the end cannot see: `Watch` finds runs orphaned
past the sweeper's bound (SPEC §13.5) and runs standing behind a DLQ record, keeps every DLQ
record that ever stood for the verdict (`judge_dlq_history`), and says how far the soak has got
every 10 s.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from nats.js.errors import NotFoundError

from store import RunfleetError, RunStatus, StoreError, utcnow
from tests.soak.config import (
    ACK_WAIT_S,
    SQLITE_BUSY_TIMEOUT_S,
    SWEEPER_GRACE_S,
    SWEEPER_INTERVAL_S,
    TIMING,
)
from tests.soak.fleet import Fleet
from tests.soak.reads import _list


class Watch(Fleet):
    """The loops that watch the fleet while the runs flow."""

    async def monitor(self) -> None:
        """SPEC §13.5: no fleet run stays queued / running / auto-resumable failed_resumable
        with no live lease and no pending message past the sweeper's interval plus grace."""
        assert self.reader is not None and self.js is not None
        from engine.failures import is_auto_resumable

        skew = timedelta(seconds=float(TIMING["LEASE_SKEW"][:-1]))
        bound = 3 * SWEEPER_INTERVAL_S + SWEEPER_GRACE_S + ACK_WAIT_S + 10.0
        while not self.stop.is_set():
            await asyncio.sleep(1.0)
            if (
                self.nats_down
                or self.in_window("store", slack=0)
                or self.in_window("post_engine", slack=0)
            ):
                continue
            try:
                runs = await _list(
                    self.reader,
                    [RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.FAILED_RESUMABLE],
                )
            except StoreError:
                continue
            now = utcnow()
            seen: set[str] = set()
            for run in runs:
                if run.status is RunStatus.FAILED_RESUMABLE and not is_auto_resumable(
                    run.failure_code
                ):
                    continue
                if run.lease is not None and run.lease.expires_at + skew > now:
                    continue
                pub = run.publication
                if pub is not None and pub.attempt == run.attempt and pub.stream_seq:
                    try:
                        await self.js.get_msg(self.names.runs_stream, pub.stream_seq)
                        continue  # its message waits (a nak delay or ack_wait)
                    except NotFoundError:
                        pass
                    except Exception:  # noqa: BLE001 - NATS hiccup: judge on the next pass
                        continue
                seen.add(run.run_id)
                first = self.orphans.setdefault(run.run_id, time.monotonic())
                since = max(first, self.last_fault_end())
                if time.monotonic() - since > bound:
                    self.report.violations.append(
                        f"run {run.run_id} orphaned for {time.monotonic() - first:.1f}s"
                        f" (> {bound:.1f}s) as {run.status} attempt {run.attempt}"
                        f" publication {pub}"
                    )
                    self.orphans[run.run_id] = float("inf")  # report once
            for run_id in list(self.orphans):
                if run_id not in seen:
                    age = time.monotonic() - self.orphans.pop(run_id)
                    if age >= 1.0:
                        self.report.orphans_repaired += 1
                        self.report.max_orphan_s = max(self.report.max_orphan_s, age)

    async def dlq_watch(self) -> None:
        """Every DLQ record that ever stands, for the verdict (`judge_dlq_history`); and no run
        stands behind one — `queued`, `running` or auto-resumable at the record's attempt —
        longer than a park's write can take in a store outage (SPEC v2.2 §5.1: the record
        first, then the park; a park that does not land withdraws the record)."""
        assert self.dlq is not None and self.reader is not None
        bound = 2 * SQLITE_BUSY_TIMEOUT_S + 10.0
        while not self.stop.is_set():
            await asyncio.sleep(1.0)
            if self.nats_down:
                continue
            try:
                records = await self.dlq.list()
            except Exception:  # noqa: BLE001 - NATS hiccup: look again on the next pass
                continue
            now = time.monotonic()
            for rec in records:
                first, _ = self.dlq_seen.setdefault(rec.id, (now, rec))
                if (
                    rec.id in self.poison
                    or rec.id in self.dlq_behind
                    or rec.run_id is None
                    or now - first <= bound
                ):
                    continue
                try:
                    run = await self.reader.get_run(rec.run_id)
                except RunfleetError:
                    continue
                parked = run.failure_code == "DLQ_PARKED" or run.status in (
                    RunStatus.FINISHED,
                    RunStatus.FAILED,
                    RunStatus.CANCELLED,
                    RunStatus.PAUSED_WAITING_HUMAN,
                )
                if run.attempt == rec.attempt and not parked:
                    self.dlq_behind.add(rec.id)
                    self.report.violations.append(
                        f"run {rec.run_id} stood {run.status} {run.failure_code or ''} at attempt"
                        f" {run.attempt} behind DLQ record {rec.id} ({rec.reason}) for"
                        f" {now - first:.0f}s"
                    )

    async def progress(self) -> None:
        assert self.reader is not None
        while not self.stop.is_set():
            await asyncio.sleep(10.0)
            try:
                counts = await self.reader.status_counts()
            except StoreError:
                continue
            statuses = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            self.say(
                f"launched {len(self.launched)}/{self.cfg.runs} finished {self.finished}"
                f" | {statuses} | kills {self.report.kills} restarts {self.report.restarts}"
            )
