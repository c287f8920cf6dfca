"""The protocol model's findings, replayed step by step (`test_protocol_model.py` finds them).

Each replay drives the machine by hand through the interleaving that broke the product, with
the known-finding list (`KNOWN`, `bookkeeping.py`) empty so that its violation is reported; a
finding still open is a strict xfail whose replay raises `KnownBugSeen`, a fixed one a plain
test."""

from __future__ import annotations

from collections.abc import Callable

from tests.model.bookkeeping import KNOWN
from tests.model.constants import ACK_WAIT, MAX_DELIVER
from tests.model.machine import ProtocolModel
from tests.model.stepping import _actor, _finish, _until

STORE_REFUSED_THEN_TAKEN_OVER = "disposition_after_lease_loss:after_store_error"


class KnownBugSeen(AssertionError):
    """The replay met exactly the violation its xfail names (any other failure fails)."""


def _replay(kind: str, scenario: Callable[[ProtocolModel], None]) -> None:
    """Replay a finding by hand with the known-bug list empty, so it is reported."""
    model = ProtocolModel()
    known = dict(KNOWN)
    KNOWN.clear()
    try:
        model.launch_record(True)  # the launch's publication record lands, as it nearly always does
        scenario(model)
        model._reap()
        violations = list(model.violations)
    finally:
        KNOWN.update(known)
        model._close()
    if violations and all(v.startswith(f"[{kind}]") for v in violations):
        raise KnownBugSeen("\n".join(violations))
    assert violations == []


def test_backstop_survives_a_message_acked_while_it_settles() -> None:
    """Found by the model: a late ack lands between the backstop's `get_msg` and its
    `delete_msg`, and a delete of a missing sequence is a `ServerError` (10057), not a
    `NotFoundError` (see the contract test). Fixed in 36fa8db (`Backstop._delete`)."""

    def scenario(m: ProtocolModel) -> None:
        m.fetch(0, 0, False)  # the first delivery: its handler will be slow
        for n in range(1, MAX_DELIVER):  # the others are never handled: ack_wait runs out
            m.advance(ACK_WAIT + 1, False)
            m.fetch(1 + n % 2, 0, False)
        m.advance(ACK_WAIT + 1, False)  # the last delivery runs out: MAX_DELIVERIES advisory
        assert [a.seq for a in m.advisories] == [1]
        slow = _actor(m, "runner0.0:deliver s1#1")
        _until(m, slow, "ack s1#1")  # claimed, executed, finished; about to ack
        m.backstop()
        backstop = _actor(m, "ops:backstop")
        _until(m, backstop, "delete_msg 1")  # judged: the run is finished, delete the message
        _finish(m, slow)  # the late ack removes the message (work queue, by sequence)
        _finish(m, backstop)

    _replay("backstop_error", scenario)


def test_a_drained_execution_that_lost_its_lease_sends_no_disposition() -> None:
    """Found by the model: a handoff CAS refused because the lease was taken over used to
    release and `ack_sync` anyway, acking the adopter's message. Fixed in
    `runner/disposition.py` `_handoff` (no disposition after a lost lease)."""

    def scenario(m: ProtocolModel) -> None:
        m.fetch(0, 0, False)
        drained = _actor(m, "runner0.0:deliver s1#1")
        _until(m, drained, "append_event node_started")  # claimed (fresh), about to run `a`
        m.drain(0)
        _until(m, drained, "update_run attempt=2")  # RUNNER_INTERRUPTED written; handoff next
        m.advance(ACK_WAIT + 1, False)  # the draining runner stalls past its lease
        m.fetch(1, 0, False)  # the redelivery: auto-retry claim of the same attempt
        adopter = _actor(m, "runner1.0:deliver s1#2")
        _until(m, adopter, "append_event run_claimed")
        _finish(m, drained)  # handoff CAS refused, release refused, then ack_sync

    _replay("disposition_after_lease_loss:handoff", scenario)


def test_an_execution_whose_status_the_store_refused_sends_no_disposition_after_a_takeover() -> (
    None
):
    """Found by the model (issue 12 item 8): an execution stalls past its lease (no beat, so
    its keeper never declares the loss), an adopter claims the run, and the stalled
    execution's status write then meets a store error. `dispose_outcome` turns that into a
    nak, tears down, calls `release()` — which finds the lease gone (a CAS conflict, returned
    as None) — and sends the nak anyway: on the same stream sequence the adopter is working on
    (SPEC §5.4: a runner that learns it lost the lease sends no disposition). Fixed in
    `runner/disposition.py` `dispose_outcome`: a release that finds the lease gone ends the
    delivery with no disposition."""

    def scenario(m: ProtocolModel) -> None:
        m.fetch(0, 0, False)
        stalled = _actor(m, "runner0.0:deliver s1#1")
        _until(m, stalled, "update_run status=finished")  # ran every node; the status next
        m.arm_fault("status", 1, False)  # the store will refuse that write
        m.advance(ACK_WAIT + 1, False)  # stalled past its lease: no beat, no loss declared
        m.fetch(1, 0, False)  # the redelivery: adoption
        adopter = _actor(m, "runner1.0:deliver s1#2")
        _until(m, adopter, "in_progress s1")  # the adopter's claim landed: it holds the lease
        _finish(m, stalled)  # status refused -> nak plan -> release finds no lease -> nak

    _replay(STORE_REFUSED_THEN_TAKEN_OVER, scenario)


def test_a_drained_execution_whose_handoff_cas_failed_sends_no_disposition_past_its_margin() -> (
    None
):
    """Found by review (issue 19, seventeenth pass), the drain's sibling of the two findings
    around it: the handoff stops the lease keeper before its CAS, so when the store refuses that
    CAS after the execution stalled past its lease, nobody has declared the loss. `_handoff`
    sent its nak anyway, on the stream sequence an adopter now works on (SPEC §5.4). Fixed in
    `runner/disposition.py` `_handoff`: past the loss margin (`CancelSignal.lease_spent`) the
    delivery ends with no disposition."""

    def scenario(m: ProtocolModel) -> None:
        m.fetch(0, 0, False)
        drained = _actor(m, "runner0.0:deliver s1#1")
        _until(m, drained, "append_event node_started")  # claimed (fresh), about to run `a`
        m.drain(0)
        _until(m, drained, "update_run attempt=2")  # RUNNER_INTERRUPTED written; handoff next
        m.arm_fault("handoff", 1, False)  # the store will refuse the handoff CAS
        m.advance(ACK_WAIT + 1, False)  # the draining runner stalls past its lease
        m.fetch(1, 0, False)  # the redelivery: auto-retry claim of the same attempt
        adopter = _actor(m, "runner1.0:deliver s1#2")
        _until(m, adopter, "append_event run_claimed")
        _finish(m, drained)  # handoff CAS refused -> (was) nak on the adopter's sequence

    _replay(STORE_REFUSED_THEN_TAKEN_OVER, scenario)


def test_an_execution_whose_release_the_store_refused_sends_no_disposition_past_its_margin() -> (
    None
):
    """Found by the model (issue 19, ninth pass): the sibling of the finding above, with the
    release the one the store refuses. An execution whose `stop_others` failed writes its
    `failed_resumable` status while its lease has run out unnoticed (no beat), and the store
    refuses the release. `dispose_outcome` sent the nak anyway, "the lease expires by
    itself", but it already had: an adopter claimed the run in between, and the nak landed
    on the stream sequence it works on (SPEC §5.4). Fixed in `runner/disposition.py`
    `dispose_outcome`: a release the store refused is followed by the disposition only while
    the lease is short of its loss margin (`CancelSignal.lease_spent`), when nobody else can
    hold the run; past it the delivery ends with none."""

    def scenario(m: ProtocolModel) -> None:
        m.arm_fault("stop_others", 1, False)  # the execution fails before its first node
        m.arm_fault("release", 1, False)  # and the store will refuse its release
        m.fetch(0, 0, False)
        stalled = _actor(m, "runner0.0:deliver s1#1")
        _until(m, stalled, "update_run status=failed_resumable")
        m.advance(ACK_WAIT + 1, False)  # stalled past its lease: no beat, no loss declared
        _until(m, stalled, "update_run -lease")  # the status landed; the release is next
        m.fetch(1, 0, False)  # the redelivery: adoption of the failed_resumable run
        adopter = _actor(m, "runner1.0:deliver s1#2")
        _until(m, adopter, "in_progress s1")  # the adopter's claim landed: it holds the lease
        _finish(m, stalled)  # release refused -> (was) nak on the adopter's sequence

    _replay(STORE_REFUSED_THEN_TAKEN_OVER, scenario)
