"""The orphan sweeper (SPEC §5.9): one pass every interval across the fleet, taken by a CAS on
a lock document so one runner sweeps at a time; `runfleet sweep` runs one pass.

It is driven by the `publication` record: a `fleet` run that should have a message on the queue
(queued, or auto-resumable `failed_resumable`) but has none — never published, or its copy is
gone — is republished; a `running` run whose lease is free and whose message is gone lost its
runner for good (`RUNNER_LOST`) and is republished. Every action is a CAS on what it read.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

import nats.errors
from nats.js.errors import NotFoundError

from engine.failures import FailureCode, is_auto_resumable
from publisher.errors import DuplicatePublication, PublishFailed
from runner.services import RunnerServices
from store import (
    CasConflict,
    Eq,
    LeaseFree,
    Origin,
    RunDocument,
    RunNotFound,
    RunQuery,
    RunStatus,
    StoreError,
    Update,
    lease_is_free,
    utcnow,
)

log = logging.getLogger(__name__)
LOCK = "runfleet-sweeper"


@dataclass
class SweepReport:
    swept: bool
    actions: Counter[str] = field(default_factory=Counter)


class Sweeper:
    def __init__(self, svc: RunnerServices) -> None:
        self.svc = svc

    async def loop(self) -> None:
        interval = self.svc.wire.sweeper_interval.total_seconds()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep_once()
            except StoreError as exc:
                log.warning("sweep skipped: store unavailable (%s)", exc)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("sweep skipped: NATS unavailable (%r)", exc)

    async def sweep_once(self, *, force: bool = False) -> SweepReport:
        svc = self.svc
        now = utcnow()
        ttl = svc.wire.sweeper_interval.total_seconds() * 2
        if not force and not await svc.store.try_lock(LOCK, svc.owner, now, ttl):
            return SweepReport(swept=False)
        report = SweepReport(swept=True)
        after: str | None = None
        while True:
            page = await svc.store.list_runs(
                RunQuery(
                    statuses=[RunStatus.QUEUED, RunStatus.FAILED_RESUMABLE, RunStatus.RUNNING],
                    origin=Origin.FLEET,
                    after_run_id=after,
                    limit=200,
                )
            )
            for run in page.runs:
                action = await self._judge(run)
                if action:
                    report.actions[action] += 1
                    svc.metrics.sweeper_actions.labels(action=action).inc()
            if page.next_after is None:
                break
            after = page.next_after
        reaped = await self._reap_sandboxes()
        if reaped:
            report.actions["sandbox_reaped"] += reaped
        return report

    async def _message_gone(self, seq: int | None) -> bool:
        if seq is None:
            return True
        try:
            await self.svc.js.get_msg(self.svc.names.runs_stream, seq)
        except NotFoundError:
            return True
        return False

    async def _judge(self, run: RunDocument) -> str | None:
        svc = self.svc
        now = utcnow()
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
            lost = await svc.store.update_run(
                run.run_id,
                [
                    Eq("status", RunStatus.RUNNING),
                    Eq("attempt", run.attempt),
                    Eq("version", run.version),
                    LeaseFree(now, svc.skew),
                ],
                Update(
                    set={
                        "status": RunStatus.FAILED_RESUMABLE,
                        "failure_code": FailureCode.RUNNER_LOST,
                        "error": "its runner vanished and its message is gone",
                    },
                    unset=["lease"],
                ),
            )
            if isinstance(lost, CasConflict):
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
            try:
                ack = await svc.publisher.publish(run, "sweep", expect_new=False)
            except (PublishFailed, DuplicatePublication) as exc:
                log.warning("sweep: run %s republish failed: %s", run.run_id, exc)
                return None
            await svc.publisher.record_publication(run, ack)
            return "republish_duplicate" if ack.duplicate else "republish_missing"
        if now - pub.at < svc.engine.lease_timing().interval:
            return None
        if not await self._message_gone(pub.stream_seq):
            return None
        return await self._republish_gone(run, "republish_gone")

    async def _republish_gone(self, run: RunDocument, action: str) -> str | None:
        """A copy that is gone is republished under `<run_id>:<attempt>:s<n>` (n counted on
        the run), so the duplicate window cannot swallow it."""
        svc = self.svc
        n = run.sweep_republishes + 1
        counted = await svc.store.update_run(
            run.run_id,
            [
                Eq("status", run.status),
                Eq("attempt", run.attempt),
                Eq("sweep_republishes", run.sweep_republishes),
            ],
            Update(set={"sweep_republishes": n}, bump_version=False),
        )
        if isinstance(counted, CasConflict):
            return None
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
        for ref in await svc.driver.list_sandboxes():
            try:
                run = await svc.store.get_run(ref.run_id)
                keep = run.lease.token if run.lease is not None else ""
            except RunNotFound:
                keep = ""  # an unknown run: its sandboxes are all orphans
            except StoreError:
                continue
            if keep != ref.token:
                reaped += len(await svc.driver.stop_others(ref.run_id, keep_token=keep))
        return reaped
