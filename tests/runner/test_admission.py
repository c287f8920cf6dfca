"""`runner.admission.judge`, rule by rule in SPEC §5.2 order (steps 3-8), on documents built by
hand: a pure function of (message, run, delivery, now)."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest

from engine.failures import FailureCode
from publisher.wire import ResumeCopy, RunMessage
from runner.admission import (
    Ack,
    AdmissionTiming,
    CancelStale,
    Claim,
    Dead,
    DeliveryInfo,
    Nak,
    Refuse,
    judge,
)
from runner.delays import busy_delay
from store import (
    Budget,
    BudgetUsage,
    Checkpoint,
    Consents,
    Lease,
    ResumeSpec,
    RunDocument,
    RunStatus,
    ScratchRecord,
    lease_is_free,
    utcnow,
)
from tests.runner.callables import new_run

S = RunStatus
NOW = utcnow()
SKEW = timedelta(seconds=0.5)
INTERVAL = timedelta(seconds=1)
BUSY_LAST = timedelta(seconds=25)
TIMING = AdmissionTiming(
    skew=SKEW, lease_interval=INTERVAL, busy_last=BUSY_LAST, lagging_delay=timedelta(seconds=2)
)
SEQ = 42
FIRST = DeliveryInfo(stream_seq=SEQ, num_delivered=1, max_deliver=10)
LAST = DeliveryInfo(stream_seq=SEQ, num_delivered=10, max_deliver=10)


def run(status: RunStatus = S.QUEUED, attempt: int = 2, **fields: Any) -> RunDocument:
    return new_run("hello", run_id="r1", status=status, attempt=attempt, **fields)


def message(attempt: int = 2, **fields: Any) -> RunMessage:
    return RunMessage(
        run_id="r1", tenant="default", attempt=attempt, kind="resume", published_at=NOW, **fields
    )


def held(attempt: int, stream_seq: int | None = SEQ, *, expires_in: float = 3.0) -> Lease:
    return Lease(
        owner="other",
        token="other-token",
        attempt=attempt,
        stream_seq=stream_seq,
        expires_at=NOW + timedelta(seconds=expires_in),
    )


def spec(attempt: int = 2, **fields: Any) -> ResumeSpec:
    return ResumeSpec(attempt=attempt, prior_status=S.FAILED_RESUMABLE, **fields)


UNBANKABLE = ScratchRecord(state="unbankable", bytes=10)
SPENT = Checkpoint(restart_node="a", usage=BudgetUsage(iterations=5))


def decide(msg: RunMessage, doc: RunDocument, delivery: DeliveryInfo = FIRST) -> Any:
    return judge(msg, doc, delivery, NOW, TIMING)


# -- step 3 ---------------------------------------------------------------------------------------


def test_superseded_older_attempt_is_acked_before_any_other_rule() -> None:
    # A newer attempt that is held, flagged and over budget: none of it matters to a stale copy.
    doc = run(
        S.RUNNING,
        attempt=3,
        lease=held(3),
        cancel_requested=True,
        checkpoint=SPENT,
        budget=Budget(max_iterations=1),
    )
    assert decide(message(attempt=2), doc) == Ack("superseded")


def test_lagging_newer_attempt_is_nakd_two_seconds() -> None:
    assert decide(message(attempt=3), run(S.QUEUED, attempt=2)) == Nak(2.0, "lagging_read")


# -- step 4 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status", [S.FINISHED, S.FAILED, S.CANCELLED, S.PAUSED_WAITING_HUMAN, S.PAUSED_OPERATOR]
)
def test_settled_status_at_the_same_attempt_is_acked(status: RunStatus) -> None:
    # Even with a lease still on it (an execution releasing) and a stale cancel flag.
    doc = run(status, lease=held(2, stream_seq=SEQ + 1), cancel_requested=True)
    assert decide(message(), doc) == Ack("settled")


@pytest.mark.parametrize(
    "code",
    [FailureCode.DLQ_PARKED, FailureCode.SCRATCH_NOT_PORTABLE, FailureCode.AMBIGUOUS_EFFECT, "BOT"],
)
def test_non_auto_resumable_failed_resumable_is_acked(code: str) -> None:
    doc = run(S.FAILED_RESUMABLE, failure_code=code)
    assert decide(message(), doc) == Ack("settled")


# -- step 5 ---------------------------------------------------------------------------------------


def test_duplicate_message_of_a_live_execution_is_acked() -> None:
    doc = run(S.RUNNING, lease=held(2, stream_seq=SEQ - 1))
    assert decide(message(), doc) == Ack("duplicate")
    assert decide(message(), doc, LAST) == Ack("duplicate")


def test_redelivery_while_owner_lives_is_nakd_one_lease_interval() -> None:
    doc = run(S.RUNNING, lease=held(2, stream_seq=SEQ))
    assert decide(message(), doc) == Nak(1.0, "redelivery_while_owner_lives")
    # Also at the last delivery: the backstop settles it (SPEC §5.6), nothing is acked here.
    assert decide(message(), doc, LAST) == Nak(1.0, "redelivery_while_owner_lives")


@pytest.mark.parametrize("num_delivered", [1, 5, 8, 9])
def test_busy_older_attempt_lease_is_nakd_on_the_busy_ladder(num_delivered: int) -> None:
    doc = run(S.QUEUED, lease=held(1, stream_seq=SEQ - 1))
    delivery = DeliveryInfo(stream_seq=SEQ, num_delivered=num_delivered, max_deliver=10)
    expected = busy_delay(num_delivered, 10, INTERVAL, BUSY_LAST)
    assert decide(message(), doc, delivery) == Nak(expected, "busy")


def test_busy_at_the_last_delivery_is_acked_without_parking() -> None:
    doc = run(S.QUEUED, lease=held(1, stream_seq=SEQ - 1))
    assert decide(message(), doc, LAST) == Ack("busy_last_delivery")


def test_held_lease_beats_a_cancel_flag_and_the_refusals() -> None:
    doc = run(
        S.RUNNING,
        lease=held(2, stream_seq=SEQ - 1),
        cancel_requested=True,
        scratch=UNBANKABLE,
        checkpoint=SPENT,
        budget=Budget(max_iterations=1),
    )
    assert decide(message(), doc) == Ack("duplicate")


# -- the lease-free predicate at its boundary ----------------------------------------------------


def test_lease_free_predicate_is_exact_at_the_skew_boundary() -> None:
    boundary = -SKEW.total_seconds()  # expires_at + skew == now
    free = run(S.RUNNING, lease=held(2, expires_in=boundary))
    taken = run(S.RUNNING, lease=held(2, expires_in=boundary + 0.001))
    assert lease_is_free(free, NOW, SKEW)
    assert not lease_is_free(taken, NOW, SKEW)
    assert decide(message(), free) == Claim("adoption")
    assert decide(message(), taken) == Nak(1.0, "redelivery_while_owner_lives")
    # Expired, but within the skew: still held.
    assert not lease_is_free(run(S.RUNNING, lease=held(2, expires_in=-0.1)), NOW, SKEW)


# -- step 6 ---------------------------------------------------------------------------------------


def test_stale_cancel_flag_is_cancelled_before_the_refusals() -> None:
    doc = run(
        S.QUEUED,
        cancel_requested=True,
        scratch=UNBANKABLE,
        checkpoint=SPENT,
        budget=Budget(max_iterations=1),
    )
    assert decide(message(), doc) == CancelStale()
    expired = run(S.RUNNING, cancel_requested=True, lease=held(2, expires_in=-5))
    assert decide(message(), expired) == CancelStale()


# -- step 7 ---------------------------------------------------------------------------------------


def test_scratch_refusal_names_its_claim_path() -> None:
    cp = Checkpoint(restart_node="a")
    cases = {
        "fresh": run(S.QUEUED, scratch=UNBANKABLE, checkpoint=cp),
        "adoption": run(S.RUNNING, scratch=UNBANKABLE, checkpoint=cp),
        "auto_retry": run(
            S.FAILED_RESUMABLE,
            failure_code=FailureCode.SANDBOX_LOST,
            scratch=UNBANKABLE,
            checkpoint=cp,
        ),
    }
    for path, doc in cases.items():
        decision = decide(message(), doc)
        assert isinstance(decision, Refuse), path
        assert (decision.kind, decision.path) == ("scratch", path)
        assert "bank" in decision.detail


def test_scratch_refusal_is_lifted_by_this_attempts_scratch_loss_consent_on_fresh_path_only() -> (
    None
):
    accepted = spec(2, consents=Consents(accept_scratch_loss=True))
    fresh = run(S.QUEUED, scratch=UNBANKABLE, resume_spec=accepted)
    assert decide(message(), fresh) == Claim("fresh")
    # The consent of an older attempt lends nothing.
    older = run(S.QUEUED, scratch=UNBANKABLE, resume_spec=spec(1, consents=accepted.consents))
    assert isinstance(decide(message(), older), Refuse)
    # Adoption and auto-retry of the same attempt never apply the consent (SPEC §5.7).
    adoption = run(S.RUNNING, scratch=UNBANKABLE, resume_spec=accepted)
    auto = run(
        S.FAILED_RESUMABLE,
        failure_code=FailureCode.RUNNER_LOST,
        scratch=UNBANKABLE,
        resume_spec=accepted,
    )
    for doc, path in [(adoption, "adoption"), (auto, "auto_retry")]:
        decision = decide(message(), doc)
        assert isinstance(decision, Refuse)
        assert (decision.kind, decision.path) == ("scratch", path)
    # A message body claiming the consent lends nothing either: the document decides.
    forged = message(resume=ResumeCopy(consents=Consents(accept_scratch_loss=True, force=True)))
    assert isinstance(decide(forged, run(S.QUEUED, scratch=UNBANKABLE)), Refuse)


def test_a_forsaken_scratch_is_not_refused() -> None:
    forsaken = UNBANKABLE.model_copy(update={"forsaken": True})
    assert decide(message(), run(S.RUNNING, scratch=forsaken)) == Claim("adoption")


def test_budget_preflight_refuses_a_spent_budget_on_every_path() -> None:
    capped = Budget(max_iterations=5)
    for status, path in [(S.QUEUED, "fresh"), (S.RUNNING, "adoption")]:
        decision = decide(message(), run(status, budget=capped, checkpoint=SPENT))
        assert isinstance(decision, Refuse)
        assert (decision.kind, decision.path) == ("budget", path)
        assert "max_iterations" in decision.detail


def test_budget_preflight_merges_the_resumes_raised_cap_on_the_fresh_path_only() -> None:
    raised = spec(2, budget=Budget(max_iterations=10))
    capped = Budget(max_iterations=5)
    fresh = run(S.QUEUED, budget=capped, checkpoint=SPENT, resume_spec=raised)
    assert decide(message(), fresh) == Claim("fresh")
    # The cap of an older attempt's request is not this attempt's.
    stale = run(
        S.QUEUED, budget=capped, checkpoint=SPENT, resume_spec=spec(1, budget=raised.budget)
    )
    assert isinstance(decide(message(), stale), Refuse)
    # After the fresh claim the merge lives in `budget`; an auto-retry does not merge again.
    auto = run(
        S.FAILED_RESUMABLE,
        failure_code=FailureCode.SANDBOX_LOST,
        budget=capped,
        checkpoint=SPENT,
        resume_spec=raised,
    )
    decision = decide(message(), auto)
    assert isinstance(decision, Refuse) and decision.kind == "budget"


def test_scratch_refusal_is_judged_before_the_budget() -> None:
    doc = run(S.QUEUED, scratch=UNBANKABLE, checkpoint=SPENT, budget=Budget(max_iterations=1))
    decision = decide(message(), doc)
    assert isinstance(decision, Refuse) and decision.kind == "scratch"


# -- step 8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "path"),
    [
        (S.QUEUED, None, "fresh"),
        (S.RUNNING, None, "adoption"),
        (S.FAILED_RESUMABLE, FailureCode.RATE_LIMITED, "auto_retry"),
        (S.FAILED_RESUMABLE, FailureCode.RUNNER_INTERRUPTED, "auto_retry"),
    ],
)
def test_claim_path_follows_the_status(status: RunStatus, code: str | None, path: str) -> None:
    # A lapsed lease (past the skew) does not stand in the way.
    doc = run(status, failure_code=code, lease=held(2, expires_in=-1))
    assert decide(message(), doc) == Claim(path)  # type: ignore[arg-type]


def test_a_state_no_rule_matches_is_dead_lettered_no_claim_path() -> None:
    # Only a bug can produce it: a status outside the table (unvalidated copy).
    doc = run(S.QUEUED).model_copy(update={"status": "archived"})
    decision = decide(message(), doc)
    assert isinstance(decision, Dead)
    assert decision.reason == "no_claim_path"


# -- the busy ladder -------------------------------------------------------------------------------


def test_busy_delay_doubles_towards_ceiling_plus_ttl_at_the_final_nak() -> None:
    interval, last = timedelta(seconds=1), timedelta(seconds=100)
    ladder = [busy_delay(n, 10, interval, last) for n in range(1, 10)]
    assert ladder[-1] == 100.0  # delivery 9 of 10: the final nak outlives the longest hold
    assert ladder[-2] == 50.0
    for earlier, later in itertools.pairwise(ladder):
        assert later == 2 * earlier or earlier == interval.total_seconds()
    assert min(ladder) == 1.0  # never below one interval
    assert ladder == sorted(ladder)
    # At (or past) the last delivery it stays at the top, never above it.
    assert busy_delay(10, 10, interval, last) == 100.0
    # A short ladder with a huge ceiling still ends exactly at the ceiling.
    assert busy_delay(1, 2, interval, timedelta(minutes=8, seconds=30)) == 510.0
    # A ceiling below one interval is raised to the interval.
    assert busy_delay(9, 10, timedelta(seconds=5), timedelta(seconds=2)) == 5.0
