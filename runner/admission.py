"""Admission (SPEC §5.2 steps 3-8): what to do with a decoded delivery, given the run as read.

A pure function of (message, run, delivery, now): nothing is written before the claim, and the
order of the rules is the order of the SPEC, so a newcomer can check one against the other.
Steps 1 (decode) and 2 (load the run) need I/O and live in `delivery.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from engine.budget import exceeded, merge_overrides
from engine.failures import is_auto_resumable
from engine.resume import scratch_problem
from publisher.wire import RunMessage
from runner.delays import busy_delay
from store import BudgetUsage, RunDocument, RunStatus, lease_is_free

ClaimPath = Literal["fresh", "adoption", "auto_retry"]


@dataclass(frozen=True, slots=True)
class DeliveryInfo:
    stream_seq: int
    num_delivered: int
    max_deliver: int

    @property
    def is_last(self) -> bool:
        return self.num_delivered >= self.max_deliver


@dataclass(frozen=True, slots=True)
class Ack:
    reason: str


@dataclass(frozen=True, slots=True)
class Nak:
    delay: float
    reason: str


@dataclass(frozen=True, slots=True)
class CancelStale:
    """Step 6: a stale `cancel_requested` on a run no execution holds."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Step 7: an engine refusal judged on the document read; parks the run, then acks."""

    kind: Literal["scratch", "budget"]
    path: ClaimPath
    detail: str


@dataclass(frozen=True, slots=True)
class Claim:
    path: ClaimPath


@dataclass(frozen=True, slots=True)
class Dead:
    """Dead-letter (record, then ack)."""

    reason: str
    detail: str
    replayable: bool = True


Decision = Ack | Nak | CancelStale | Refuse | Claim | Dead

SETTLED = frozenset(
    {
        RunStatus.FINISHED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.PAUSED_WAITING_HUMAN,
        RunStatus.PAUSED_OPERATOR,
    }
)


@dataclass(frozen=True, slots=True)
class AdmissionTiming:
    skew: timedelta
    lease_interval: timedelta
    busy_last: timedelta
    lagging_delay: timedelta


def _path_for(run: RunDocument) -> ClaimPath | None:
    if run.status is RunStatus.QUEUED:
        return "fresh"
    if run.status is RunStatus.RUNNING:
        return "adoption"
    if run.status is RunStatus.FAILED_RESUMABLE and is_auto_resumable(run.failure_code):
        return "auto_retry"
    return None


_NOTHING_USED = BudgetUsage()
"""The accounting of a run with no checkpoint (read only)."""


def effective_budget_usage(run: RunDocument, path: ClaimPath) -> str | None:
    """The budget preflight on the document as the claim would leave it."""
    budget = run.budget
    spec = run.resume_spec
    if path == "fresh" and spec is not None and spec.attempt == run.attempt:
        budget = merge_overrides(budget, spec.budget)
    if run.checkpoint is None:
        return exceeded(budget, _NOTHING_USED)  # not a whole `Checkpoint()` per fresh claim
    return exceeded(budget, run.checkpoint.usage)


def is_settled(run: RunDocument) -> bool:
    """Nothing is left to do at the run's attempt (§5.2 step 4): a final status, a pause, or a
    failure no delivery retries by itself. The backstop judges a dead message by it too."""
    return run.status in SETTLED or (
        run.status is RunStatus.FAILED_RESUMABLE and not is_auto_resumable(run.failure_code)
    )


def judge(
    message: RunMessage,
    run: RunDocument,
    delivery: DeliveryInfo,
    now: datetime,
    timing: AdmissionTiming,
) -> Decision:
    # Step 3: attempts.
    if message.attempt < run.attempt:
        return Ack("superseded")
    if message.attempt > run.attempt:
        return Nak(timing.lagging_delay.total_seconds(), "lagging_read")
    # Step 4: nothing to do at this attempt.
    if is_settled(run):
        return Ack("settled")
    # Step 5: the lease is held by another execution.
    if not lease_is_free(run, now, timing.skew):
        lease = run.lease
        assert lease is not None
        if lease.attempt == run.attempt:
            if lease.stream_seq != delivery.stream_seq:
                return Ack("duplicate")
            return Nak(timing.lease_interval.total_seconds(), "redelivery_while_owner_lives")
        if delivery.is_last:
            return Ack("busy_last_delivery")  # the sweeper republishes (SPEC §5.2 step 5)
        delay = busy_delay(
            delivery.num_delivered, delivery.max_deliver, timing.lease_interval, timing.busy_last
        )
        return Nak(delay, "busy")
    # Step 6: a stale cancel flag.
    if run.cancel_requested:
        return CancelStale()
    path = _path_for(run)
    if path is None:
        return Dead("no_claim_path", f"status {run.status} at attempt {run.attempt}")
    # Step 7: engine refusals before the claim.
    spec = run.resume_spec
    accepted = (
        path == "fresh"
        and spec is not None
        and spec.attempt == run.attempt
        and spec.consents.accept_scratch_loss
    )
    why = scratch_problem(run)
    if why is not None and not accepted:
        return Refuse("scratch", path, why)
    over = effective_budget_usage(run, path)
    if over is not None:
        return Refuse("budget", path, over)
    # Step 8.
    return Claim(path)
