"""A model-based test of the claim / lease / disposition protocol (SPEC §2, §4, §5, §13).

A `hypothesis.stateful` machine drives the REAL product code against the REAL `SqliteRunStore`
(a fresh file per example) and the broker double of `tests/model/broker.py` (held to a real
nats-server by `test_broker_contract.py`), and checks the invariants of SPEC §13 after every
step. CI runs a bounded number of examples (100 of at most 80 steps, about ten seconds);
run it long with (`-s` prints how many steps ran, and in how many examples each path of the
protocol was taken):

    RUNFLEET_MODEL_EXAMPLES=2500 .venv/bin/pytest tests/model/test_protocol_model.py -q -s \\
        -p no:cacheprovider --hypothesis-seed=20261201

`RUNFLEET_MODEL_STEPS` sets the most steps per example. A failure prints the steps, what every
actor did at each (`runner1.0:deliver s2#1~5: update_run status=running ...`) and a
`@reproduce_failure` blob.

What runs for real: `runner.delivery.handle` (decode, load, `runner.admission.judge`, the claim,
`cancel_stale`, `park_refusal`, the draining runner's hand-on of a last delivery, dead-lettering,
the bounded claim retries, the settled-event repair), `runner.delivery._execute` and `_run`
(`Execution.claimed`, `HeldLease` with its claim's working ack and its registration for the
control subject and the drain, `Execution.begin` — `stop_others`, then `run_claimed` — the
check for a drain that began while the claim's CAS was in flight, any error as the outcome
`INTERNAL_ERROR`), `engine.execution.Execution` (a workflow of call / human / fail nodes: no
sandbox), `FencedWriter`, `LeaseKeeper.refresh_once`, `runner.disposition.dispose_outcome`
(the status from `status_for`, the DLQ record before a last delivery's park and its withdrawal
when the park does not land, teardown, release, the drain's handoff CAS, ack / nak, the nak of
an unwritable status), `Publisher` (launch, resume with its CAS and flip-back, cancel, replay),
`engine.rewind.rewind`, `Backstop.settle_advisory` and `Sweeper.sweep_once`.

What the model supplies:
- **actors and gates**: every product coroutine runs as an actor that stops before each store,
  broker and DLQ operation until the machine grants it that one operation, so hypothesis picks
  the interleaving at every I/O point; a crash cancels actors at their gates (leases stay until
  they expire, deliveries come back after `ack_wait`). Nothing else runs an actor: signals (a
  drain, a lease loss) are seen at the next grant, so every example is deterministic;
- **time**: a `Clock` the machine advances; `utcnow` is patched to it in the modules that read
  the time, so lease expiry, `LeaseFree(now, skew)`, nak delays, ack_wait, the sweeper's grace
  and rewind's lease check all run on model time, and nothing sleeps;
- the lease keeper's clock: the real `HeldLease` builds a `ModelLeaseKeeper` (the real
  `LeaseKeeper` whose `run()` loop, which sleeps in real time, only waits to be stopped), and
  the machine calls its `refresh_once`, then the `HeldLease`'s beat (the working ack), when a
  beat happens. A beat past `expires_at - loss_margin` is the keeper giving up, and an event
  append is abandoned once the lease's time is out (`EventLog`'s deadline, `ModelEventLog`):
  both decided on model time instead of racing a real 1 ms timeout. `runner.delivery` builds
  `ModelEventLog` and `ModelExecution` (whose teardown banks a drawn scratch) in place of
  theirs, and its `dispose_outcome` is the real one, noted on the way;
- the store's operations run on the loop's thread (`InlineWorker`) in a tmpfs file: the same
  SQL and transactions without a thread hop and an fsync per step;
- node results and the scratch record a teardown banks are drawn when they happen;
- faults (`tests/model/faults.py`): one-shot errors armed at a step of a delivery — a store
  error at admission; under the held lease `stop_others`, the `run_claimed` append, a workflow
  that no longer loads, the sandbox's stop in teardown; the store unreachable at the status
  write, the park, the release, the handoff CAS or a status event, possibly after the write
  landed (a lost reply) — and hostile bodies on the work subject and the advisory subject;
  a drain at any point of a delivery (a claim's CAS in flight included), and a drain that lands
  between a fetch and its handler (so a draining runner holds a last delivery).

Invariants, checked at the write, append or disposition that could break them and after every
step: (1) a token whose lease ended never writes again; an execution's status and checkpoint
writes carry the attempt fence; a claim only takes a free lease; (2) a superseded or duplicate
delivery writes and appends nothing; (3) consent effects (forsaken scratch, forced source,
answers, raised caps) are written only by the fresh claim of the attempt that carried them, and
that claim writes them; (4) every delivery ends acked, nak'd with a delay, dead-lettered (a park
`DLQ_PARKED` follows its record), or abandoned by an execution that lost its lease; no ack or
nak after the lease was taken over; (5) at the end of each example every actor crashes, the
sweeper's interval and grace pass, one sweeper pass runs, and a fleet run left `queued`,
`running` or auto-resumable has a message on its way; (6) a node in `completed` runs again only
as a resumable fail's guard (rewind drops what it re-runs), and `completed` shrinks only by
rewind; (7) `attempt` and budget accounting never decrease; (8) no claim, queueing or sweeper
republish of a deterministic, operator-resumable or bot failure; (10, partly) no claim leaves an
unportable scratch or an exhausted budget behind. Also: no error log from the product, no
exception escaping a loop (backstop, sweeper), an operator call fails only with a refusal.
New with issue 12 (SPEC v2.2): an error under the held lease never reaches the delivery's last
resort (it is an outcome); a delivery that dead-lettered its run's current attempt leaves the
run parked or settled, never `queued` / `running` / auto-resumable behind the record, and at the
end no run is left so unless another copy of its attempt is on its way (after the backstop and
the sweeper had their turn); the sweeper never republishes a run whose current copy was
dead-lettered; a draining runner's last delivery of a run it could claim never ends nak'd
(a rollout parks no healthy run); every hostile body ends as a `malformed` record, not
replayable, and only hostile bodies do; every hostile advisory is acked; no loop dies (§13.12).

Findings are listed in `KNOWN` and replayed step by step in `test_protocol_replays.py`.

Where things are, in `tests/model/`: `machine.py` (`ProtocolModel`: its rules, its invariant,
the end of an example), `judging.py` (the invariants checked where a write, an event, an ack or
nak, a publish or a node start happens), `doubles.py` (the store, broker, DLQ, sandbox and
execution doubles), `actors.py` (actors and their gates), `constants.py` (time, limits, the
product's settings), `workflow.py` (the model's workflow and its call node), `bookkeeping.py`
(the running machine, coverage, `KNOWN`), `stepping.py` (driving the machine by hand),
`faults.py` and `broker.py`; the step-by-step tests are in `test_protocol_replays.py` and
`test_protocol_scenarios.py`.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.model.bookkeeping import COVERAGE, STEPS_TAKEN
from tests.model.machine import ProtocolModel

EXAMPLES = int(os.environ.get("RUNFLEET_MODEL_EXAMPLES", "100"))
STEPS = int(os.environ.get("RUNFLEET_MODEL_STEPS", "80"))


@pytest.mark.timeout(max(120, EXAMPLES))
def test_protocol_model() -> None:
    COVERAGE.clear()
    STEPS_TAKEN[0] = 0
    started = time.monotonic()
    run_state_machine_as_test(
        ProtocolModel,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            print_blob=True,
            database=None,
            # No `explain` phase: it re-runs the failing example under `sys.settrace`, which
            # on Python 3.11 costs minutes here and adds nothing the notes do not say.
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ),
    )
    print(
        f"\nprotocol model: {COVERAGE['examples']} examples, {STEPS_TAKEN[0]} steps (at most"
        f" {STEPS} each), {time.monotonic() - started:.0f} s; in how many examples each"
        " happened:"
    )
    for what, n in sorted(COVERAGE.items()):
        print(f"  {n:6d}  {what}")
