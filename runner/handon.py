"""Handing on a queued run's last delivery while draining (SPEC v2.2 §5.8, ADR-0010).

A draining runner naks what it fetches, so another runner takes it a second later. At the
*last* allowed delivery a nak would instead send the message to the backstop, which parks the
run `DLQ_PARKED` — a rollout would dead-letter healthy runs. So a run that is `queued` at the
message's attempt (lease free) is handed on as a new attempt, which spends no delivery budget:
one CAS `queued ∧ attempt ∧ version ∧ lease free` → `attempt + 1`; publish `kind: handoff`;
record it; `ack_sync` the old delivery. A crash in between is repaired by the sweeper (a queued
run with no publication for its attempt).

The resume request of the old attempt moves with it (`resume_spec.attempt` re-stamped in the
same CAS): no claim applied it yet, so the fresh claim of the new attempt is the first and only
one that applies its effects (SPEC §5.7, §13.3 still hold); without the re-stamp an operator's
answers would be silently dropped.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime
from typing import Any

from publisher.errors import DuplicatePublication, PublishFailed
from runner.deliveries import Delivery
from runner.services import RunnerServices
from store import CasConflict, Eq, LeaseFree, RunDocument, RunStatus, StoreError, Update

log = logging.getLogger(__name__)


async def hand_on(svc: RunnerServices, delivery: Delivery, run: RunDocument, now: datetime) -> bool:
    """Hand the queued run on as `attempt + 1`. False when the CAS lost (judge again)."""
    attempt = run.attempt
    fields: dict[str, Any] = {"attempt": attempt + 1, "attempt_at": now}
    spec = run.resume_spec
    if spec is not None and spec.attempt == attempt:
        fields["resume_spec"] = spec.model_copy(update={"attempt": attempt + 1}).model_dump()
    result = await svc.store.update_run(
        run.run_id,
        [
            Eq("status", RunStatus.QUEUED),
            Eq("attempt", attempt),
            Eq("version", run.version),
            LeaseFree(now, svc.skew),
        ],
        Update(set=fields),
    )
    if isinstance(result, CasConflict):
        return False
    await publish_handoff(svc, result)
    await delivery.ack_sync()
    await svc.delivery_log.disposed(delivery, "ack", "handed_on")
    log.info("run %s: last delivery handed on as attempt %d (draining)", run.run_id, attempt + 1)
    return True


async def publish_handoff(svc: RunnerServices, run: RunDocument) -> None:
    """Publish the handed-off attempt, record it and say `run_queued`. A failure here is
    logged, not raised: the run is `queued`/auto-resumable with no publication for its
    attempt, which the sweeper republishes (SPEC §5.9). It is said on the run too
    (`run_publish_failed`), where `events` and the console show it: the runner's log alone
    was found by a cluster walkthrough to leave a quorum loss's stalled runs unexplained."""
    try:
        ack = await svc.publisher.publish(run, "handoff")
        await svc.publisher.record_publication(run, ack)
        await svc.store.append_event(
            run.run_id,
            "run_queued",
            {"attempt": run.attempt, "kind": "handoff"},
            attempt=run.attempt,
        )
    except (PublishFailed, DuplicatePublication, StoreError) as exc:
        log.warning("run %s: handoff publish failed (%s); the sweeper republishes", run.run_id, exc)
        with contextlib.suppress(StoreError):
            await svc.store.append_event(
                run.run_id,
                "run_publish_failed",
                {
                    "attempt": run.attempt,
                    "kind": "handoff",
                    "reason": str(exc)[:500],
                    "next": "the sweeper republishes it once a runner sweeps",
                },
                attempt=run.attempt,
            )
