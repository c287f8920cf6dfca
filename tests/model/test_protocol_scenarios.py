"""The protocol model's v2.2 faults, played step by step (issue 12 item 8; SPEC v2.2 §5.1, §5.6,
§5.8, §5.9, §13.12).

The random exploration of `test_protocol_model.py` reaches these interleavings only now and
then (a fault armed at the very step a last delivery takes, a drain landing on a claim's CAS).
Each test here drives the same machine — the real runner, backstop and sweeper code against the
real SQLite store and the broker double — through one of them, checks every invariant at each
step and at the end (every actor crashed, the backstop's turn, one sweeper pass), and asserts
that the path it names was taken, so it cannot pass vacuously.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.failures import FailureCode
from tests.model.actors import AdvisoryState
from tests.model.constants import ACK_WAIT, NAMES, TTL
from tests.model.faults import BAD_ADVISORIES, DEEP, HUGE_DIGITS, inject, message
from tests.model.machine import ProtocolModel
from tests.model.stepping import _actor, _finish, _until


def _play(
    scenario: Callable[[ProtocolModel], None],
    then: Callable[[ProtocolModel], None] | None = None,
) -> set[str]:
    """Run `scenario`, judge it by the model's invariants, check what `then` expects of the
    state it left, then play the end of an example; returns what happened (the coverage
    labels). Any violation of an invariant fails the test."""
    model = ProtocolModel()
    try:
        model.launch_record(True)  # the launch's publication record lands, as it nearly always does
        scenario(model)
        model._reap()
        assert model.violations == [], model.violations
        if then is not None:
            then(model)
        model._no_orphan()
        assert model.violations == [], model.violations
        assert model.known == [], model.known
        return set(model.seen)
    finally:
        model._close()


def _spend_deliveries(m: ProtocolModel, count: int) -> None:
    """`count` deliveries of the run's message whose handlers never get past their first
    step (their runner stalls): each runs out its ack_wait."""
    for n in range(count):
        m.fetch(n % 3, 0, False)
        m.advance(ACK_WAIT + 1, False)


def test_claim_whose_cas_lands_after_the_drain_broadcast_runs_no_node() -> None:
    """v2.2 §5.8: the drain broadcast lands while the claim's CAS is in flight (its cancel
    signal is not registered yet); the execution sees `draining` once its lease is taken and
    hands off before its first node (the model's `ran_after_drain` would flag a node)."""

    def scenario(m: ProtocolModel) -> None:
        m.fetch(0, 0, False)
        claiming = _actor(m, "runner0.0:deliver s1#1")
        _until(m, claiming, "update_run status=running")  # the claim's CAS, in flight
        m.drain(0)
        _finish(m, claiming)

    seen = _play(scenario)
    assert "drain raced a claim's CAS" in seen
    assert "claim won after the drain began: handed off before its first node" in seen
    assert "plan:handoff:drain" in seen


def test_an_execution_that_stalled_past_its_lease_margin_starts_no_node() -> None:
    """SPEC §13.1: the claim lands, then its runner stalls at the claim's working ack while
    the lease's time runs out (no beat: the keeper never says the lease is lost). Once through,
    the execution starts no node (the model's `node_started_past_the_lease_margin` would flag
    it) and abandons the delivery, writing nothing; the run is left to an adopter. Found by the
    random model before the node-start check (`CancelSignal.lease_spent`)."""

    def scenario(m: ProtocolModel) -> None:
        m.fetch(0, 0, False)
        claiming = _actor(m, "runner0.0:deliver s1#1")
        _until(m, claiming, "in_progress")  # the claim's CAS landed; its working ack is next
        m.advance(TTL + 3, False)
        _finish(m, claiming)

    def nothing_ran(m: ProtocolModel) -> None:
        cp = m.last_doc.checkpoint
        assert cp is None or not cp.completed, cp

    seen = _play(scenario, nothing_ran)
    assert "delivery abandoned after its lease was lost" in seen
    assert "node started inside its lease" not in seen


def test_draining_runner_hands_on_the_last_delivery_of_a_queued_run() -> None:
    """v2.2 §5.8: a runner drains between fetching the last allowed delivery of a `queued` run
    and handling it; it judges it and hands it on as a new attempt, never naks it to the
    backstop (`drain_naked_last_delivery`)."""

    def scenario(m: ProtocolModel) -> None:
        _spend_deliveries(m, 2)
        m.fetch(2, 0, True)  # the third and last delivery; SIGTERM before its handler runs
        _finish(m, _actor(m, "runner2.0:deliver s1#3"))

    def handed_on(m: ProtocolModel) -> None:
        assert m.last_doc.attempt == 2

    seen = _play(scenario, handed_on)
    assert "draining runner holds delivery #3" in seen
    assert "hand-on: a draining runner's last delivery became a new attempt" in seen


def test_park_that_does_not_land_leaves_no_record_standing() -> None:
    """v2.2 §5.1, §5.6: at the last delivery an error under the held lease (the `run_claimed`
    append) is the outcome INTERNAL_ERROR, parked: the DLQ record first, then the park write —
    which the store refuses. The record is withdrawn and the delivery nak'd: no record stands
    behind a `running` run (`left_behind_record`); the backstop parks it later, with its own."""

    def scenario(m: ProtocolModel) -> None:
        _spend_deliveries(m, 2)
        m.arm_fault("run_claimed", 1, False)
        m.arm_fault("park", 1, False)
        m.fetch(2, 0, False)
        _finish(m, _actor(m, "runner2.0:deliver s1#3"))

    def withdrawn(m: ProtocolModel) -> None:
        assert m.dlq.records == {}

    seen = _play(scenario, withdrawn)
    assert {"fault:run_claimed", "fault:park", "dlq:retries_exhausted"} <= seen
    assert "plan:nak:store_unreachable" in seen
    assert "backstop:parked" in seen  # at the end, after the message ran out of deliveries


def test_sweeper_parks_a_run_whose_copy_the_backstop_dead_lettered() -> None:
    """§5.9 (issue 12 item 6): the backstop's park meets an unexpected error, so its catch-all
    records the message `internal_error` and deletes it, leaving the run `queued`. The
    sweeper, finding the copy gone, parks the run behind its record instead of republishing
    it (`swept_dead_lettered`), which would only loop it through the DLQ."""

    def scenario(m: ProtocolModel) -> None:
        _spend_deliveries(m, 3)
        assert [a.seq for a in m.advisories] == [1]
        m.arm_fault("backstop", 1, False)
        m.backstop()
        _finish(m, _actor(m, "ops:backstop s1"))
        assert m.dlq.records[1].reason == "internal_error"
        m.sweep()
        _finish(m, _actor(m, "ops:sweep"))

    def parked(m: ProtocolModel) -> None:
        assert m.last_doc.failure_code == FailureCode.DLQ_PARKED

    seen = _play(scenario, parked)
    assert {"fault:backstop", "backstop:internal_error", "sweeper:dlq_parked"} <= seen


def test_hostile_bodies_end_as_malformed_records_through_the_runner_and_the_backstop() -> None:
    """v2.2 §5.2 step 1, §13.12: a 5 000-digit integer, 200 000-deep nesting, a wrong type and
    a lying header each end as a `malformed` record, whether a runner decodes them or the
    backstop does after their deliveries ran out; a hostile advisory is acked; no task
    raises."""

    def scenario(m: ProtocolModel) -> None:
        body = message(m.run_id, 1)
        hostile = {
            "deep": (b"[" * DEEP + b"]" * DEEP, {}),
            "huge_int": (inject(body, "attempt", b"9" * HUGE_DIGITS), {}),
            "wrong_type": (inject(body, "run_id", b"[]"), {}),
            "header": (inject(body, "attempt", b"1"), {"Runfleet-Attempt": "9" * HUGE_DIGITS}),
        }
        seqs: dict[str, int] = {}
        for kind, (data, headers) in hostile.items():
            seqs[kind] = m.queue.publish(NAMES.runs_subject, data, headers).seq
            m.hostile[seqs[kind]] = kind
        m.advisories.append(AdvisoryState(0, m.clock.now, data=BAD_ADVISORIES[-1]))
        for kind in ("huge_int", "wrong_type", "header"):  # a runner decodes these
            seq = seqs[kind]
            m.fetch(0, m.queue.deliverable().index(seq), False)
            _finish(m, _actor(m, f"runner0.0:deliver s{seq}#1"))
        for _ in range(3):  # the deep one runs out its deliveries: the backstop's to settle
            m.fetch(1, m.queue.deliverable().index(seqs["deep"]), False)
            m.advance(ACK_WAIT + 1, False)
        while m._advisory_ready() is not None:
            m.backstop()
            _finish(m, next(a for a in m.actors if a.kind == "backstop"))

    def recorded(m: ProtocolModel) -> None:
        assert {seq: r.reason for seq, r in m.dlq.records.items()} == {
            seq: "malformed" for seq in m.hostile
        }

    seen = _play(scenario, recorded)
    assert {"backstop:malformed", "backstop:bad_advisory", "dlq:malformed"} <= seen


def test_an_error_at_each_step_under_the_held_lease_parks_the_run_once() -> None:
    """v2.2 §5.1: `stop_others` raising, then the `run_claimed` append failing, then a stored
    workflow that no longer loads — one per delivery — are each the outcome `INTERNAL_ERROR`
    (never the last resort, `escaped_to_last_resort`): nak'd twice, then parked once at the
    last delivery, `DLQ_PARKED` with one record, which the sweeper leaves alone."""

    def scenario(m: ProtocolModel) -> None:
        for point in ("stop_others", "run_claimed", "load"):
            m.arm_fault(point, 1, False)
        for n in range(3):
            m.fetch(n, 0, False)
            _finish(m, _actor(m, f"runner{n}.0:deliver s1#{n + 1}"))
            m.advance(ACK_WAIT + 1, False)
        m.sweep()
        _finish(m, _actor(m, "ops:sweep"))

    def parked_once(m: ProtocolModel) -> None:
        doc = m.last_doc
        assert (doc.status, doc.failure_code, doc.cause_code) == (
            "failed_resumable",
            FailureCode.DLQ_PARKED,
            FailureCode.INTERNAL_ERROR,
        )
        assert [(r.reason, r.attempt) for r in m.dlq.records.values()] == [("retries_exhausted", 1)]

    seen = _play(scenario, parked_once)
    assert {"fault:stop_others", "fault:run_claimed", "fault:load"} <= seen
    assert {"plan:nak:transient", "plan:ack:dlq_parked"} <= seen
