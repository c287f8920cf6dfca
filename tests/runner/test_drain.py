"""Drain (SPEC §5.1, §5.6 drain row, §5.8): SIGTERM stops fetching, interrupts in-flight
executions, and hands each run off as a new attempt — `failed_resumable RUNNER_INTERRUPTED`,
never `cancelled` — published afresh so the handoff spends none of the delivery budget; then the
runner exits 0 within the unwind ceiling. A message fetched while draining is nak'd with a 1 s
delay, for another runner to take."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from engine.failures import FailureCode
from publisher.wire import decode
from store import RunStatus, utcnow
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import (
    ledger,
    released,
    runner_process,
    sample,
    wait_for_ledger,
    workflow,
)
from tests.runner.test_held_lease import start_on


async def test_sigterm_during_a_long_node_hands_off_as_a_new_attempt_and_a_second_runner_finishes_without_rerunning_completed_nodes(  # noqa: E501
    fleet: Fleet, tmp_path: Path
) -> None:
    book, release = tmp_path / "ledger", tmp_path / "release"
    ceiling = fleet.engine.unwind_ceiling.total_seconds()
    async with runner_process(fleet, "runner-a") as a:
        run = await fleet.launch(
            workflow("three_steps"), {"ledger": str(book), "release": str(release)}
        )
        await wait_for_ledger(book, "two")
        first = await fleet.store.get_run(run.run_id)
        assert first.publication is not None and first.publication.stream_seq is not None
        first_seq = first.publication.stream_seq
        sent = time.monotonic()
        a.signal(signal.SIGTERM)
        code = await a.wait_exit(ceiling + 30)
        took = time.monotonic() - sent
        said = a.log()
    # Its log says what the stop did, run by run (found by an operator walkthrough).
    assert f"draining: 1 run(s) to hand off ({run.run_id})" in said, said
    assert any(line.endswith(" stopped") for line in said.splitlines()), said

    # Handed off, not cancelled: a new attempt, queued as a fresh publication.
    handed = await fleet.store.get_run(run.run_id)
    assert handed.status is RunStatus.FAILED_RESUMABLE
    assert handed.failure_code == FailureCode.RUNNER_INTERRUPTED
    assert handed.attempt == 2 and handed.lease is None
    assert handed.checkpoint is not None
    assert handed.checkpoint.completed == ["one"] and handed.checkpoint.restart_node == "two"
    assert handed.publication is not None and handed.publication.attempt == 2
    new_seq = handed.publication.stream_seq
    assert new_seq is not None and new_seq != first_seq
    events = await fleet.store.read_events(run.run_id)
    types = [e.type for e in events]
    assert "run_cancelled" not in types
    queued = [e.data for e in events if e.type == "run_queued"]
    assert queued == [{"attempt": 1, "kind": "launch"}, {"attempt": 2, "kind": "handoff"}]
    # The failure is in the history before the handoff, as every failure is (SPEC §6.3;
    # found by an operator walkthrough: `node_started` was followed by `run_queued` alone).
    failed = [e for e in events if e.type == "run_failed"]
    assert [e.data["code"] for e in failed] == ["RUNNER_INTERRUPTED"]
    handed_off = max(i for i, t in enumerate(types) if t == "run_queued")
    assert failed[0].attempt == 1 and types.index("run_failed") < handed_off

    # The old delivery was acked (gone); the handoff is a new message (attempt 2, kind handoff).
    try:
        await fleet.js.get_msg(fleet.names.runs_stream, first_seq)
        raise AssertionError("the interrupted delivery was not acked")
    except NotFoundError:
        pass
    handoff = await fleet.js.get_msg(fleet.names.runs_stream, new_seq)
    message = decode(handoff.data or b"", dict(handoff.headers or {}))
    assert (message.attempt, message.kind) == (2, "handoff")
    # Before any other runner runs, nobody may have taken the new message yet: its first
    # delivery (num_delivered 1) must be the next execution's.
    before_b = await fleet.js.consumer_info(fleet.names.runs_stream, fleet.names.consumer)

    release.touch()
    b = await fleet.start_runner()
    await fleet.wait_status(run.run_id, "finished")
    done = await eventually(released(fleet, run.run_id))
    assert done.attempt == 2
    assert done.publication is not None and done.publication.stream_seq == new_seq
    events = await fleet.store.read_events(run.run_id)
    claims = [(e.attempt, e.data["path"]) for e in events if e.type == "run_claimed"]
    assert claims == [(1, "fresh"), (2, "auto_retry")]
    assert ledger(book) == {"one": 1, "two": 2, "three": 1}
    assert sample(b, "runfleet_claims_total", path="auto_retry", outcome="won") == 1
    # What the scale-down cost, counted where it can be scraped: on the runner that took it
    # (the drained one's counters lived under a second; an autoscaling walkthrough).
    assert sample(b, "runfleet_handoffs_taken_total") == 1
    assert await fleet.queue_drained()
    problems = []
    if before_b.delivered.stream_seq >= new_seq or before_b.num_ack_pending:
        problems.append(
            f"the handoff message (seq {new_seq}) was already delivered before runner B started"
            f" (consumer delivered={before_b.delivered}, num_ack_pending="
            f"{before_b.num_ack_pending}): B got it as a redelivery (num_delivered >= 2), so"
            " the handoff spent delivery budget"
        )
    if code != 0:
        problems.append(f"runner A exited {code} on SIGTERM, not 0; log:\n{a.log()}")
    if took > ceiling:
        problems.append(f"runner A took {took:.1f}s to exit (ceiling {ceiling:.0f}s)")
    assert not problems, "\n".join(problems)


async def test_a_message_fetched_while_draining_is_nakd_with_a_one_second_delay_and_redelivered_to_another_runner(  # noqa: E501
    fleet: Fleet, tmp_path: Path
) -> None:
    book = tmp_path / "ledger"
    a = await fleet.start_runner(slots=1, sweeper=False, backstop=False)
    assert a.svc is not None
    a.svc.draining = True  # what SIGTERM sets first; A keeps its fetch loop for this test
    run = await fleet.launch(workflow("one_step"), {"ledger": str(book)})

    def nakd_count() -> float:
        return sample(a, "runfleet_deliveries_total", disposition="nak", reason="draining")

    async def nakd() -> bool:
        return nakd_count() >= 1

    await eventually(nakd)
    nakd_at = utcnow()
    await a.shutdown()  # A stops fetching; the nak'd message waits out its delay
    assert nakd_count() == 1
    assert sample(a, "runfleet_claims_total", path="fresh", outcome="won") == 0
    untouched = await fleet.store.get_run(run.run_id)
    assert untouched.status is RunStatus.QUEUED and untouched.lease is None

    b = await fleet.start_runner()
    await fleet.wait_status(run.run_id, "finished")
    done = await eventually(released(fleet, run.run_id))
    events = await fleet.store.read_events(run.run_id)
    claim = next(e for e in events if e.type == "run_claimed")
    assert claim.data["runner"] == b.owner and claim.data["path"] == "fresh"
    waited = (claim.at - nakd_at).total_seconds()
    assert waited >= 0.9, f"redelivered {waited:.2f}s after the nak: the 1 s delay was not kept"
    # ...and it came back because of the nak, not because an abandoned delivery timed out.
    assert waited < fleet.wire.effective_ack_wait.total_seconds()
    # The same message, redelivered (not a new publication).
    assert run.publication is not None and done.publication is not None
    assert done.publication.stream_seq == run.publication.stream_seq
    assert ledger(book) == {"ran": 1}
    assert await fleet.queue_drained()


class _SlowAfterHandoff:
    """The real store, whose reply to the drain's handoff CAS comes late (a slow store or
    network): long enough for the lease keeper to beat twice if it still ran."""

    def __init__(self, inner: Any, late_s: float) -> None:
        self.inner = inner
        self.late_s = late_s
        self.handed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_run(self, run_id: str, conditions: Any, update: Any, **kw: Any) -> Any:
        result = await self.inner.update_run(run_id, conditions, update, **kw)
        if "attempt" in update.set and "lease" in update.unset:  # the handoff CAS
            self.handed = True
            await asyncio.sleep(self.late_s)  # the slow reply itself, not a synchronisation
        return result


async def test_the_drain_handoff_is_not_mistaken_for_a_takeover_by_the_lease_keeper(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The handoff CAS drops the lease: the keeper is stopped before it, so a beat that finds
    the lease gone does not log `taken over` nor mark the execution's lease lost (the chaos
    soak's log showed both, for a handoff whose publish waited out a NATS restart)."""
    book, release = tmp_path / "ledger", tmp_path / "release"
    interval = fleet.engine.lease_timing().interval.total_seconds()
    store = _SlowAfterHandoff(fleet.store, late_s=2.5 * interval)
    runner = await start_on(fleet, store)
    run = await fleet.launch(
        workflow("three_steps"), {"ledger": str(book), "release": str(release)}
    )
    await wait_for_ledger(book, "two")
    with caplog.at_level(logging.INFO, logger="engine.lease"):
        await runner.shutdown()
    assert store.handed
    handed = await fleet.store.get_run(run.run_id)
    assert handed.attempt == 2 and handed.lease is None
    assert handed.failure_code == FailureCode.RUNNER_INTERRUPTED
    lost = [r.getMessage() for r in caplog.records if r.name == "engine.lease"]
    assert not [m for m in lost if "taken over" in m or "lease lost" in m], lost
