"""The orphan sweeper (SPEC §5.9): one pass every interval across the fleet, taken by a CAS on
a lock document so one runner sweeps at a time; `runfleet sweep` runs one pass.

A pass reads the runs it may act on as `RunCopy` rows and the runs stream's state once
(`publisher.queue_snapshot`): a run whose recorded copy is still on the queue — nearly every run
of a backlog — is passed over without reading its document or asking the stream about it, so
a pass costs what it acts on plus a few µs per queued run (issue 19).

It is driven by the `publication` record: a `fleet` run that should have a message on the queue
(queued, or auto-resumable `failed_resumable`) but has none — never published, or its copy is
gone — is republished; a `running` run whose lease is free and whose message is gone lost its
runner for good (`RUNNER_LOST`) and is republished. A run whose copy is gone because it was
dead-lettered at that attempt is parked `DLQ_PARKED` instead: republishing it would only send it
back to the DLQ, forever (issue 12 item 1).

Every action is a CAS on the status, attempt and `publication` it read, and lease free (§2, §5.9);
every publish comes after the CAS that allows it, so two sweepers, or a sweeper racing a late
PubAck record, never publish one copy twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import nats.errors
from nats.js.errors import NotFoundError

from engine.failures import FailureCode, is_auto_resumable
from engine.sandbox.errors import SandboxError
from engine.scratch import sweep_orphan_banks
from publisher.dlq import DlqRecord
from publisher.errors import DuplicatePublication, PublishFailed, RecordNotFound
from publisher.queue_snapshot import QueueSnapshot, queue_snapshot
from runner.services import RunnerServices
from store import (
    CasConflict,
    Condition,
    DocumentInvalid,
    Eq,
    LeaseFree,
    Origin,
    RunCopy,
    RunDocument,
    RunNotFound,
    RunQuery,
    RunStatus,
    RunStore,
    StoreError,
    Update,
    lease_is_free,
    utcnow,
)
from store.config import StoreSettings
from store.staging import StagingStore

log = logging.getLogger(__name__)
LOCK = "runfleet-sweeper"
SWEPT = (RunStatus.QUEUED, RunStatus.FAILED_RESUMABLE, RunStatus.RUNNING)
"""The statuses §5.9 acts on; every other run is passed over."""
PAGE = 1000
"""Runs per page of the pass: `RunCopy` rows, a few dozen bytes each."""

Clock = Callable[[], datetime]


@dataclass
class SweepReport:
    swept: bool
    actions: Counter[str] = field(default_factory=Counter)
    cut_short: bool = False
    """The pass stopped early: its lock could not be kept (another runner's pass may run)."""

    @property
    def outcome(self) -> str:
        """The `outcome` label of `runfleet_sweeper_passes`."""
        if not self.swept:
            return "not_elected"
        return "cut_short" if self.cut_short else "swept"


class PassLock:
    """The sweeper's election lock, held through the whole pass (SPEC §5.9).

    Taken for `ttl` (two sweeper intervals), checked before every action and renewed whenever
    less than half of it is left, so every action starts with at least `ttl / 2` (one interval)
    of lock ahead of it — more than an action takes by default (its publish is bounded by the
    publisher's retry budget, 20 s against a 30 s interval); one that takes longer is still
    fenced by its own CAS. A lock that lapsed is never retaken mid-pass — another runner may
    have swept meanwhile — so the pass stops instead (`SweepReport.cut_short`)."""

    def __init__(self, store: RunStore, owner: str, ttl: timedelta, clock: Clock) -> None:
        self.store = store
        self.owner = owner
        self.ttl = ttl
        self.clock = clock
        self.expires: datetime | None = None

    async def take(self) -> bool:
        now = self.clock()
        if not await self.store.try_lock(LOCK, self.owner, now, self.ttl.total_seconds()):
            self.expires = None
            return False
        self.expires = now + self.ttl
        return True

    async def hold(self) -> bool:
        """True while the lock is ours with at least half its TTL left (renewing it when
        less is left); False once it is lost or lapsed: the pass must stop."""
        if self.expires is None:
            return False
        now = self.clock()
        if now >= self.expires:
            log.warning("sweep: the pass outlived its lock; stopping it")
            self.expires = None
            return False
        if self.expires - now >= self.ttl / 2:
            return True
        return await self.take()


class Sweeper:
    def __init__(
        self,
        svc: RunnerServices,
        *,
        clock: Clock | None = None,
        upload_ttl: timedelta | None = None,
    ) -> None:
        self.svc = svc
        self._clock = clock
        self._upload_ttl = upload_ttl if upload_ttl is not None else StoreSettings().upload_ttl
        """`RUNFLEET_UPLOAD_TTL`: staged uploads never promoted are reaped after it (§8)."""
        self._snapshot: QueueSnapshot | None = None

    def now(self) -> datetime:
        return self._clock() if self._clock is not None else utcnow()

    async def loop(self) -> None:
        interval = self.svc.wire.sweeper_interval.total_seconds()
        metrics = self.svc.metrics
        while True:
            await asyncio.sleep(interval)
            try:
                report = await self.sweep_once()
            except StoreError as exc:
                log.warning("sweep skipped: store unavailable (%s)", exc)
                outcome = "skipped"
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("sweep skipped: NATS unavailable (%r)", exc)
                outcome = "skipped"
            except Exception:  # a bug in one pass must not stop the runner
                # The lock passes to the next runner, which would meet the same run and stop
                # too: the fleet would go down one runner at a time (found by review).
                log.exception("sweep failed; the next pass tries again")
                outcome = "failed"
            else:
                outcome = report.outcome
                if outcome == "swept":
                    # What an alert reads: with no runner's stamp moving, no runner finishes a
                    # pass (one wedged on a call that never returns, every pass cut short or
                    # failing), and runs the sweeper would mend wait for good.
                    metrics.sweeper_last_pass.set_to_current_time()
            metrics.child(metrics.sweeper_passes, outcome).inc()

    async def sweep_once(self, *, force: bool = False) -> SweepReport:
        """One pass. `force` (the CLI's `runfleet sweep`) takes no lock: its actions are CASes
        on what they read, so a pass beside a runner's is safe, only redundant."""
        svc = self.svc
        lock: PassLock | None = None
        if not force:
            lock = PassLock(svc.store, svc.owner, svc.wire.sweeper_interval * 2, self.now)
            if not await lock.take():
                return SweepReport(swept=False)
        report = SweepReport(swept=True)
        self._snapshot = None
        after: str | None = None
        while True:
            page = await svc.store.list_run_copies(
                RunQuery(
                    statuses=SWEPT,
                    origin=Origin.FLEET,
                    after_run_id=after,
                    limit=PAGE,
                )
            )
            for copy in page.copies:
                if copy.status == RunStatus.FAILED_RESUMABLE and not is_auto_resumable(
                    copy.failure_code
                ):
                    continue  # parked for a person: no rule acts on it (`_judge`), no read
                if await self._copy_on_queue(copy):
                    continue  # every rule of §5.9 needs the copy missing or gone
                if lock is not None and not await lock.hold():
                    report.cut_short = True
                    return report
                try:
                    run = await svc.store.get_run(copy.run_id)
                except RunNotFound:
                    continue  # deleted since the page was read (`gc`)
                except DocumentInvalid as exc:
                    # One unreadable document must not stop the pass for every run after it
                    # (found by review): it is logged and counted, and the pass goes on.
                    log.error("sweep: run %s does not validate; passed over: %s", copy.run_id, exc)
                    report.actions["unreadable"] += 1
                    continue
                action = await self._judge(run)
                if action:
                    report.actions[action] += 1
                    svc.metrics.sweeper_actions.labels(action=action).inc()
            if page.next_after is None:
                break
            after = page.next_after
        if lock is not None and not await lock.hold():
            report.cut_short = True
            return report
        reaped = await self._reap_sandboxes()
        if reaped:
            report.actions["sandbox_reaped"] += reaped
        if svc.blobs is not None:  # bytes before record (`StagingStore.reap`)
            uploads = await StagingStore(svc.store, svc.blobs).reap(self._upload_ttl, self.now())
            if uploads:
                report.actions["upload_reaped"] += uploads
            banks = await sweep_orphan_banks(svc.store, svc.blobs, svc.skew)  # §7.3
            if banks:
                report.actions["scratch_bank_reaped"] += banks
        return report

    async def _queue(self) -> QueueSnapshot:
        """The runs stream's state, asked once per pass, when first needed (a pass with no
        fleet run to look at asks nothing)."""
        if self._snapshot is None:
            self._snapshot = await queue_snapshot(self.svc.nc, self.svc.names.runs_stream)
        return self._snapshot

    async def _copy_on_queue(self, copy: RunCopy) -> bool:
        """The run's recorded copy is for its attempt and was on the queue at this pass's
        snapshot: nothing to do, and its document need not even be read. Stale is safe: a
        copy gone since is seen by the next pass; one that is not is never judged gone."""
        if copy.published_attempt != copy.attempt or copy.stream_seq is None:
            return False
        return (await self._queue()).gone(copy.stream_seq) is False

    async def _message_gone(self, seq: int | None) -> bool:
        if seq is None:
            return True
        known = (await self._queue()).gone(seq)
        if known is not None:
            return known
        try:
            await self.svc.js.get_msg(self.svc.names.runs_stream, seq)
        except NotFoundError:
            return True
        return False

    def _as_read(self, run: RunDocument) -> list[Condition]:
        """The conditions of every sweeper CAS (§5.9): the status, attempt and `publication`
        read, and lease free. A `publication` write bumps no version, so only these fields
        fence a late PubAck record or a claim that recorded its delivery meanwhile."""
        pub = run.publication
        return [
            Eq("status", run.status),
            Eq("attempt", run.attempt),
            Eq("publication.attempt", pub.attempt if pub else None),
            Eq("publication.stream_seq", pub.stream_seq if pub else None),
            Eq("publication.at", pub.at if pub else None),
            LeaseFree(self.now(), self.svc.skew),
        ]

    async def _judge(self, run: RunDocument) -> str | None:
        svc = self.svc
        now = self.now()
        if run.origin is not Origin.FLEET or run.status not in SWEPT:
            return None  # moved on since its `RunCopy` row was read (found by the model)
        if not lease_is_free(run, now, svc.skew):
            return None
        pub = run.publication
        if run.status is RunStatus.RUNNING:
            if (
                pub is not None
                and pub.attempt == run.attempt
                and not await self._message_gone(pub.stream_seq)
            ):
                return None  # redelivered after ack_wait: the adoption path takes it
            record = await self._dead_letter_record(run)
            if record is not None:
                return await self._park(run, record)
            lost = await self._fail_resumable(
                run,
                [*self._as_read(run), Eq("version", run.version)],
                FailureCode.RUNNER_LOST,
                "its runner vanished and its message is gone",
            )
            if lost is None:
                return None
            await svc.store.append_event(
                run.run_id,
                "run_failed",
                {"code": FailureCode.RUNNER_LOST, "error": lost.error},
                attempt=run.attempt,
            )
            return await self._republish_gone(lost, "runner_lost")
        if run.status is RunStatus.FAILED_RESUMABLE and not is_auto_resumable(run.failure_code):
            return None
        if pub is None or pub.attempt != run.attempt:
            if now - run.attempt_at < svc.wire.sweeper_grace:
                return None
            return await self._republish_missing(run)
        if now - pub.at < svc.lease.interval:
            return None
        if not await self._message_gone(pub.stream_seq):
            return None
        record = await self._dead_letter_record(run)
        if record is not None:
            return await self._park(run, record)
        return await self._republish_gone(run, "republish_gone")

    async def _dead_letter_record(self, run: RunDocument) -> DlqRecord | None:
        """The DLQ record of the run's current copy, when that copy was dead-lettered at the
        run's attempt (a runner's last delivery, the backstop)."""
        pub = run.publication
        if pub is None or pub.attempt != run.attempt or pub.stream_seq is None:
            return None
        try:
            record = await self.svc.dlq.get(pub.stream_seq)
        except RecordNotFound:
            return None
        if record.run_id != run.run_id or record.attempt != run.attempt:
            return None
        return record

    async def _park(self, run: RunDocument, record: DlqRecord) -> str | None:
        """A run left `queued`, `running` or auto-resumable behind the DLQ record of its last
        delivery (say an admission-phase internal error there) is parked `DLQ_PARKED`, as the
        backstop would have; an operator's resume or a replay of the record brings it back."""
        svc = self.svc
        parked = await self._fail_resumable(
            run,
            self._as_read(run),
            FailureCode.DLQ_PARKED,
            f"its last delivery was dead-lettered ({record.reason[:80]})",
            cause_code=run.failure_code,
        )
        if parked is None:
            return None
        await svc.store.append_event(
            run.run_id,
            "run_dlq_parked",
            {"reason": record.reason, "record_id": record.id},
            attempt=run.attempt,
        )
        return "dlq_parked"

    async def _fail_resumable(
        self,
        run: RunDocument,
        conditions: list[Any],
        code: str,
        error: str,
        *,
        cause_code: str | None = None,
    ) -> RunDocument | None:
        """`failed_resumable` with `code`, the lease dropped, by CAS on what was read; None
        when the run moved meanwhile (the next pass judges it again)."""
        fields: dict[str, Any] = {
            "status": RunStatus.FAILED_RESUMABLE,
            "failure_code": code,
            "error": error,
        }
        if code == FailureCode.DLQ_PARKED:
            fields["cause_code"] = cause_code
        result = await self.svc.store.update_run(
            run.run_id, conditions, Update(set=fields, unset=["lease"])
        )
        return None if isinstance(result, CasConflict) else result

    async def _count(self, run: RunDocument) -> RunDocument | None:
        """The CAS that allows one republish: bump the sweep counter `n` on what was read.
        Only the winner publishes; the loser (another pass, or a run whose publication was
        recorded meanwhile) publishes nothing."""
        counted = await self.svc.store.update_run(
            run.run_id,
            [*self._as_read(run), Eq("sweep_republishes", run.sweep_republishes)],
            Update(set={"sweep_republishes": run.sweep_republishes + 1}, bump_version=False),
        )
        return None if isinstance(counted, CasConflict) else counted

    async def _republish_missing(self, run: RunDocument) -> str | None:
        """No publication for the attempt: republish under the original `<run_id>:<attempt>`
        (a duplicate answer means the original landed: its sequence is recorded)."""
        svc = self.svc
        counted = await self._count(run)
        if counted is None:
            return None
        try:
            ack = await svc.publisher.publish(counted, "sweep", expect_new=False)
        except (PublishFailed, DuplicatePublication) as exc:
            log.warning("sweep: run %s republish failed: %s", run.run_id, exc)
            return None
        await svc.publisher.record_publication(counted, ack)
        return "republish_duplicate" if ack.duplicate else "republish_missing"

    async def _republish_gone(self, run: RunDocument, action: str) -> str | None:
        """A copy that is gone is republished under `<run_id>:<attempt>:s<n>` (n counted on
        the run), so the duplicate window cannot swallow it."""
        svc = self.svc
        counted = await self._count(run)
        if counted is None:
            return None
        n = counted.sweep_republishes
        try:
            ack = await svc.publisher.publish(counted, "sweep", sweep=n)
        except (PublishFailed, DuplicatePublication) as exc:
            log.warning("sweep: run %s republish failed: %s", run.run_id, exc)
            return None
        await svc.publisher.record_publication(counted, ack, sweep=n)
        await svc.store.append_event(
            run.run_id,
            "run_queued",
            {"attempt": run.attempt, "kind": "sweep"},
            attempt=run.attempt,
        )
        return action

    async def _reap_sandboxes(self) -> int:
        """Sandboxes whose run's lease is no longer theirs (listed first, then the runs read,
        so a sandbox started after the read is never mistaken for an orphan)."""
        svc = self.svc
        reaped = 0
        try:
            refs = await svc.driver.list_sandboxes()
        except SandboxError as exc:  # e.g. the API server of sandbox pods is unreachable
            log.warning("sweep: sandboxes not listed, none reaped this pass: %s", exc)
            return 0
        for ref in refs:
            try:
                run = await svc.store.get_run(ref.run_id)
                keep = run.lease.token if run.lease is not None else ""
            except RunNotFound:
                keep = ""  # an unknown run: its sandboxes are all orphans
            except StoreError:
                continue
            if keep != ref.token:
                try:
                    reaped += len(await svc.driver.stop_others(ref.run_id, keep_token=keep))
                except SandboxError as exc:
                    log.warning("sweep: sandboxes of run %s not reaped: %s", ref.run_id, exc)
        return reaped
