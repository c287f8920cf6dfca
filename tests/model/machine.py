"""The machine: `ProtocolModel`, a `hypothesis.stateful` machine over the real product code.

Its rules are what can happen next (a fetch, an actor's next operations, a crash, a drain, a
fault armed, a hostile message, a beat, time passing, an operator's call, a backstop or sweeper
pass); its invariant and its teardown check the run after every step and at the end of each
example. What it judges where it happens is in `judging.py`; the doubles it builds the world
from are in `doubles.py`; `test_protocol_model.py` runs it."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Coroutine
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import engine.execution
import engine.lease
import runner.delivery
import runner.lease
import store.timeutil
from engine.cancel import CancelSignal
from engine.outcome import CancelReason
from engine.resume import ResumeRequest
from engine.rewind import rewind
from publisher.launch_records import PendingRecord
from publisher.publisher import Publisher
from publisher.wire import HDR_MSG_ID, RunMessage, decode, encode
from runner.admission import DeliveryInfo
from runner.backstop import Backstop
from runner.deliveries import Delivery
from runner.metrics import RunnerMetrics
from runner.services import RunnerServices
from runner.sweeper import Sweeper
from store import Budget, RunDocument
from store.sqlite import SqliteRunStore
from store.sqlite import connect as sqlite_connect
from store.timeutil import truncate_ms
from tests.model import bookkeeping
from tests.model.actors import ACTOR, Actor, AdvisoryState, Live
from tests.model.bookkeeping import COVERAGE, KNOWN, STEPS_TAKEN, _Errors, _note, _seen
from tests.model.broker import Clock, Delivered, WorkQueue
from tests.model.constants import (
    ACK_WAIT,
    ADVISORY_ACK_WAIT,
    BASE,
    DUP_WINDOW,
    ENGINE,
    FAST_TMP,
    INTERVAL,
    MARGIN,
    MAX_DELIVER,
    NAMES,
    RUNNER,
    RUNNERS,
    SKEW,
    SLOTS,
    SWEEPER_GRACE,
    SWEEPER_INTERVAL,
    WIRE,
)
from tests.model.doubles import (
    AdvisoryMsg,
    InlineWorker,
    ModelBlobs,
    ModelDlq,
    ModelEventLog,
    ModelExecution,
    ModelJetStream,
    ModelLeaseKeeper,
    ModelMsg,
    ModelNats,
    NullDriver,
    WatchedStore,
    _judge,
    _model_dispose,
    _model_load,
)
from tests.model.faults import BAD_ADVISORIES, LOST_REPLY, POINTS, ModelFault, draw_hostile
from tests.model.judging import Judging, _orphanable
from tests.model.workflow import NODES, V1, V2


class ProtocolModel(Judging, RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        bookkeeping._MODEL = self
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp(prefix="runfleet-model-", dir=FAST_TMP))
        self.clock = Clock()
        self.queue = WorkQueue(
            self.clock,
            stream=NAMES.runs_stream,
            ack_wait=ACK_WAIT,
            max_deliver=MAX_DELIVER,
            duplicate_window=DUP_WINDOW,
        )
        self.violations: list[str] = []
        self.known: list[str] = []
        self.seen: set[str] = set()
        self.actors: list[Actor] = []
        self.executions: dict[str, Live] = {}
        self.dead_tokens: dict[str, str] = {}
        """Lease tokens that no document holds any more: `self` (released or handed off by
        its execution) or `other` (taken over, or unset by anyone else)."""
        self.advisories: list[AdvisoryState] = []
        self._advised = 0
        """How many of the queue's advisories `advisories` holds (hostile ones come on top)."""
        self.control: list[str] = []
        self.fault: str | None = None
        self.faults: Counter[str] = Counter()
        """Armed faults by point (`tests/model/faults.py`), each firing once per count."""
        self.lost_reply: dict[str, bool] = {}
        self.injected: list[BaseException] = []
        self.hostile: dict[int, str] = {}
        """Hostile messages in the work stream, by sequence (their kind)."""
        self.drained: list[CancelSignal] = []
        """The cancel signals a drain broadcast reached (registered before it)."""
        self.steps = 0
        self._data: st.DataObject | None = None
        self._serial = 0
        self._patches: list[tuple[Any, str, Any]] = []
        self._patch_all()
        self._log = _Errors(self)
        logging.getLogger().addHandler(self._log)
        db = self.tmp / "runs.db"
        self.raw = SqliteRunStore(db, InlineWorker(sqlite_connect(db, 10_000)))  # type: ignore[arg-type]
        self.store = WatchedStore(self.raw, self)
        self.js = ModelJetStream(self)
        self.nc = ModelNats(self)
        self.dlq = ModelDlq(self)
        self.metrics = RunnerMetrics()
        self.generation = [0] * RUNNERS
        self.runners = [self._services(f"runner{i}.0") for i in range(RUNNERS)]
        self.ops = self._services("ops")
        # The launch leaves its publication record to be written later (issue 19 lever 3,
        # `publisher/launch_records.py`): the `launch_record` rule decides whether it ever lands.
        self.pending_record: PendingRecord | None = None

        def hold(doc: RunDocument, ack: Any, at: datetime) -> None:
            self.pending_record = PendingRecord(0.0, doc, ack, at)

        self.ops.publisher.launch_records.add = hold  # type: ignore[method-assign]
        launched = self.run(self.ops.publisher.launch(V1, {}, tenant="default"))
        self.run_id = launched.run_id
        self.last_doc = self.prev_doc = self.run(self.raw.get_run(self.run_id))

    # -- plumbing ----------------------------------------------------------------------------

    def _patch_all(self) -> None:
        # Every product module that reads the time through `store.utcnow` (found by identity,
        # so a function moving between modules keeps running on model time).
        for name, module in sorted(sys.modules.items()):
            if name.split(".")[0] not in ("runner", "engine", "publisher"):
                continue
            if getattr(module, "utcnow", None) is store.timeutil.utcnow:
                self._patch(module, "utcnow", self.now)
        # The lease holder's own clock (`engine.lease.held_clock`, a clock nobody sets) runs
        # on model time too: on real time, a lease at its boundary read differently from one
        # replay of an example to the next (hypothesis called the model flaky).
        self._patch(engine.lease, "held_clock", lambda: self.now().timestamp())
        self._patch(runner.delivery, "judge", _judge)
        # The real `_execute` and `_run`, with the keeper's clock the machine's (`doubles.py`).
        self._patch(runner.lease, "LeaseKeeper", ModelLeaseKeeper)
        self._patch(runner.delivery, "EventLog", ModelEventLog)
        self._patch(runner.delivery, "Execution", ModelExecution)
        self._patch(runner.delivery, "dispose_outcome", _model_dispose)
        self._patch(engine.execution, "stored_workflow", _model_load)

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _services(self, owner: str) -> RunnerServices:
        publisher_ = Publisher(
            store=self.store,  # type: ignore[arg-type]
            nc=self.nc,  # type: ignore[arg-type]
            js=self.js,  # type: ignore[arg-type]
            settings=WIRE,
            names=NAMES,
            dlq=self.dlq,  # type: ignore[arg-type]
        )
        return RunnerServices(
            store=self.store,  # type: ignore[arg-type]
            blobs=ModelBlobs(self.tmp / "blobs"),
            nc=self.nc,  # type: ignore[arg-type]
            js=self.js,  # type: ignore[arg-type]
            names=NAMES,
            wire=WIRE,
            engine=ENGINE,
            settings=RUNNER,
            driver=NullDriver(),
            metrics=self.metrics,
            publisher=publisher_,
            dlq=self.dlq,  # type: ignore[arg-type]
            data_dir=self.tmp / "data",
            owner=owner,
        )

    def now(self) -> datetime:
        return truncate_ms(BASE + timedelta(seconds=self.clock.now))

    def run(self, aw: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(aw)

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        """Draw inside a step (a node's result, a teardown's bank); None outside one."""
        return None if self._data is None else self._data.draw(strategy)

    def take_fault(self, point: str) -> bool:
        """Fire the fault armed at `point`, if any, for the delivery actor that reached it."""
        actor = ACTOR.get()
        if self.faults[point] <= 0 or actor is None or actor.kind not in ("delivery", "backstop"):
            return False
        self.faults[point] -= 1
        actor.faults.add(point)
        lost = " (reply lost)" if self.lost_reply.get(point) and point in LOST_REPLY else ""
        _note(f"{actor.name}: fault at {point}{lost}")
        _seen(f"fault:{point}{lost}")
        return True

    def inject(self, exc: BaseException) -> BaseException:
        self.injected.append(exc)
        return exc

    def is_injected(self, exc: BaseException | None) -> bool:
        """Whether `exc` (or what caused it) is an error the machine raised on purpose."""
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if isinstance(exc, ModelFault):
                return True
            if any(exc is x for x in self.injected):
                return True
            exc = exc.__cause__ or exc.__context__
        return False

    def violation(self, kind: str, text: str) -> None:
        if kind in KNOWN:
            self.known.append(f"{kind}: {text}")
            _seen(f"known bug: {kind}")
            return
        self.violations.append(f"[{kind}] {text}")

    def _start(self, actor: Actor, coro: Coroutine[Any, Any, Any]) -> None:
        """Start an actor and let it run to its first gate."""
        self._serial += 1
        actor.name = f"{actor.name}~{self._serial}"
        self.actors.append(actor)

        async def started() -> None:
            actor.start(coro)
            await actor.changed.wait()

        self.run(started())
        _note(f"{actor.name} started, at: {actor.label}")
        self._reap()

    def _grant(self, actor: Actor) -> None:
        _note(f"{actor.name}: {actor.label}")
        actor.grant()
        self.run(actor.changed.wait())

    def _round_robin(self, rounds: int, data: st.DataObject) -> None:
        self._data = data
        try:
            for _ in range(rounds):
                for actor in [a for a in self.actors if a.parked]:
                    if actor.parked:
                        self._grant(actor)
        finally:
            self._data = None
        self._reap()

    def _cancel(self, actor: Actor) -> None:
        assert actor.task is not None
        actor.crashed = True
        actor.task.cancel()
        self.run(asyncio.wait([actor.task]))
        if actor.live is not None:
            actor.live.keeper.stop()  # the keeper dies with its process
        _note(f"{actor.name} crashed at: {actor.label}")

    def _reap(self) -> None:
        for actor in [a for a in self.actors if a.done]:
            self.actors.remove(actor)
            if actor.task is not None and not actor.task.cancelled():
                self._finished(actor)

    def live_executions(self) -> list[Live]:
        return [x for x in self.executions.values() if not x.ended and x.keeper_alive]

    def _beat(self, live: Live, working_ack: bool) -> None:
        """One beat of the execution's `HeldLease`: refresh by CAS, then the working ack."""
        deadline = live.keeper.expires_at - timedelta(seconds=MARGIN)
        if self.now() >= deadline:
            live.cancel.cancel(CancelReason.LEASE_LOST)
            live.keeper_alive = False
            _note(f"keeper {live.token[:8]} gave up (past its loss margin)")
            return
        ok = self.run(live.keeper.refresh_once())
        _note(f"keeper {live.token[:8]} refresh: {'ok' if ok else 'lost'}")
        if not ok:
            live.keeper_alive = False
            return
        if working_ack and live.keeper.on_beat is not None:
            self.run(live.keeper.on_beat())  # `HeldLease._beat`: the working ack

    def _sync_advisories(self) -> None:
        for adv in self.queue.advisories[self._advised :]:
            self.advisories.append(AdvisoryState(adv.stream_seq, self.clock.now))
            _seen("advisory")
        self._advised = len(self.queue.advisories)

    def _free_slot(self, runner_index: int) -> bool:
        """A draining runner has stopped fetching (it only naks what it had fetched)."""
        if self.runners[runner_index].draining:
            return False
        return sum(1 for a in self.actors if a.runner == runner_index) < SLOTS

    def _fetchable(self) -> bool:
        due = self.queue.next_due()
        return due is not None and due <= self.clock.now

    def _fetch(self, runner_index: int, pick: int, *, drain_first: bool = False) -> None:
        seqs = self.queue.deliverable()
        self._sync_advisories()
        if not seqs or not self._free_slot(runner_index):
            return
        d = self.queue.deliver(seqs[pick % len(seqs)])
        _seen(f"delivery #{d.num_delivered}")
        if drain_first:
            # SIGTERM lands between the fetch and the handler: the runner holds the message.
            self._drain(runner_index)
            _seen(f"draining runner holds delivery #{d.num_delivered}")
        self._deliver_to(self.runners[runner_index], runner_index, d)

    def _deliver_to(self, svc: RunnerServices, runner_index: int | None, d: Delivered) -> Actor:
        """Start the real `handle` of one delivery, as the runner's supervised task."""
        delivery = Delivery(
            msg=ModelMsg(self, d),  # type: ignore[arg-type]
            info=DeliveryInfo(d.seq, d.num_delivered, MAX_DELIVER),
        )
        actor = Actor(f"{svc.owner}:deliver s{d.seq}#{d.num_delivered}", "delivery", runner_index)
        actor.delivery = delivery
        actor.svc = svc
        self._start(actor, runner.delivery.handle(svc, delivery))
        return actor

    def _drive(self, actor: Actor, coro: Coroutine[Any, Any, Any]) -> None:
        """Start an actor and grant it every operation until it ends (the end of an example)."""
        self._start(actor, coro)
        self._drive_to_end(actor)

    def _drain(self, runner_index: int) -> None:
        """SIGTERM, in `Runner.shutdown`'s order: `draining` first, then the cancel of every
        execution registered (by `HeldLease`) with reason `drain`. A claim whose CAS is in
        flight is not registered yet: it must see `draining` after its lease is taken."""
        svc = self.runners[runner_index]
        svc.draining = True
        for cancel in list(svc.executions.values()):
            cancel.cancel(CancelReason.DRAIN)
            self.drained.append(cancel)
            _seen("drain")
        for actor in self.actors:
            claiming = actor.delivery is not None and not actor.delivery.leased
            if actor.svc is svc and claiming and "lease" in actor.label.split():
                _seen("drain raced a claim's CAS")

    # -- rules: the broker and the runners -----------------------------------------------------

    @precondition(lambda self: self._fetchable())
    @rule(
        runner_index=st.integers(0, RUNNERS - 1),
        pick=st.integers(0, 3),
        drain_first=st.sampled_from([False, False, False, True]),
    )
    def fetch(self, runner_index: int, pick: int, drain_first: bool) -> None:
        """A runner pulls one message; `pick` chooses among the deliverable ones (reordering).
        With `drain_first`, SIGTERM lands before its handler starts: a non-last delivery is
        nak'd for 1 s, the last one is judged — a `queued` run's is handed on as a new
        attempt, a claimable one is handed off at once (v2.2 §5.8)."""
        self._fetch(runner_index, pick, drain_first=drain_first)

    @precondition(lambda self: any(a.parked for a in self.actors))
    @rule(pick=st.integers(0, 7), count=st.sampled_from([1, 2, 4, 12, 200]), data=st.data())
    def step(self, pick: int, count: int, data: st.DataObject) -> None:
        """Let one actor through `count` of its operations."""
        parked = [a for a in self.actors if a.parked]
        actor = parked[pick % len(parked)]
        self._data = data
        try:
            for _ in range(count):
                if not actor.parked:
                    break
                self._grant(actor)
        finally:
            self._data = None
        self._reap()

    @precondition(lambda self: any(a.parked for a in self.actors))
    @rule(rounds=st.sampled_from([1, 3, 10]), data=st.data())
    def step_all(self, rounds: int, data: st.DataObject) -> None:
        """Every actor, round robin, one operation per round."""
        self._round_robin(rounds, data)

    @rule(rounds=st.sampled_from([2, 6, 20]), data=st.data())
    def progress(self, rounds: int, data: st.DataObject) -> None:
        """A healthy stretch: every runner with a free slot fetches what is deliverable, then
        every actor takes `rounds` operations, round robin."""
        for runner_index in range(RUNNERS):
            if self._fetchable() and self._free_slot(runner_index):
                self._fetch(runner_index, 0)
        self._round_robin(rounds, data)

    def _crashable(self) -> list[str]:
        runners = {f"runner{a.runner}" for a in self.actors if a.runner is not None}
        runners |= {f"runner{i}" for i, svc in enumerate(self.runners) if svc.draining}
        others = [a.name for a in self.actors if a.runner is None and a.parked]
        return sorted(runners) + others

    @precondition(lambda self: bool(self._crashable()))
    @rule(pick=st.integers(0, 7))
    def crash(self, pick: int) -> None:
        """A process dies where it stands: a runner (its tasks stop, its leases stay until
        they expire, its deliveries come back after ack_wait; a new process takes its place),
        or an operator's CLI, a backstop or a sweeper pass."""
        targets = self._crashable()
        target = targets[pick % len(targets)]
        if "~" not in target:
            runner_index = int(target.removeprefix("runner"))
            for actor in [a for a in self.actors if a.runner == runner_index]:
                self._cancel(actor)
            self._reap()
            self.generation[runner_index] += 1
            generation = self.generation[runner_index]
            self.runners[runner_index] = self._services(f"runner{runner_index}.{generation}")
            _seen("crash runner")
            return
        actor = next(a for a in self.actors if a.name == target)
        self._cancel(actor)
        if actor.on_done is not None:
            actor.on_done()
        self._reap()
        _seen("crash operator")

    def _drainable(self) -> list[int]:
        return sorted(
            {
                a.runner
                for a in self.actors
                if a.runner is not None and not self.runners[a.runner].draining
            }
        )

    @precondition(lambda self: bool(self._drainable()))
    @rule(pick=st.integers(0, 3))
    def drain(self, pick: int) -> None:
        """SIGTERM to a runner with deliveries in hand, wherever each stands (admission, a
        claim's CAS in flight, a node, the disposition): it stops fetching and cancels its
        executions with reason `drain` (each hands off, SPEC §5.6); a claim that wins after
        the broadcast is handed off at once, and a last delivery is judged (v2.2 §5.8)."""
        runners = self._drainable()
        self._drain(runners[pick % len(runners)])

    @precondition(lambda self: sum(self.faults.values()) < 4)
    @rule(
        point=st.sampled_from(POINTS),
        times=st.sampled_from([1, 1, 1, 2, 3]),
        lost_reply=st.booleans(),
    )
    def arm_fault(self, point: str, times: int, lost_reply: bool) -> None:
        """Arm a fault: the next `times` deliveries to reach `point` meet an error there
        (`tests/model/faults.py`); at a store point its reply may be lost after the write."""
        self.faults[point] += times
        self.lost_reply[point] = lost_reply

    @precondition(lambda self: len(self.hostile) + self._hostile_advisories() < 4)
    @rule(advisory=st.sampled_from([False, False, False, True]), data=st.data())
    def hostile_message(self, advisory: bool, data: st.DataObject) -> None:
        """Someone publishes a hostile body on the work subject, aimed at the model's run
        (garbage, a 5 000-digit integer, 200 000-deep nesting, a wrong type, a lying header),
        or an advisory that names no sequence reaches the backstop's consumer."""
        if advisory:
            body = data.draw(st.sampled_from(BAD_ADVISORIES))
            self.advisories.append(AdvisoryState(0, self.clock.now, data=body))
            _seen("hostile advisory")
            return
        doc = self.last_doc
        hostile = draw_hostile(data, doc.run_id, doc.attempt)
        ack = self.queue.publish(NAMES.runs_subject, hostile.body, hostile.headers)
        self.hostile[ack.seq] = hostile.kind
        _seen(f"hostile body:{hostile.kind}")

    def _hostile_advisories(self) -> int:
        return sum(1 for a in self.advisories if a.data is not None)

    @precondition(lambda self: bool(self.live_executions()))
    @rule(pick=st.integers(0, 3), working_ack_lost=st.booleans())
    def beat(self, pick: int, working_ack_lost: bool) -> None:
        """One lease refresh (and working ack, unless it is lost) of one execution."""
        lives = self.live_executions()
        self._beat(lives[pick % len(lives)], not working_ack_lost)

    @rule(
        seconds=st.sampled_from([1.0, 3.0, 10.0, 20.0, 33.0, 65.0, 130.0, 600.0]),
        keepers_beat=st.booleans(),
    )
    def advance(self, seconds: float, keepers_beat: bool) -> None:
        """Time passes; healthy keepers beat every interval meanwhile (or everyone stalls)."""
        left = seconds
        while left > 0:
            dt = min(INTERVAL, left) if keepers_beat else left
            self.clock.advance(dt)
            left -= dt
            if keepers_beat:
                for live in self.live_executions():
                    self._beat(live, True)
        self.queue.deliverable()
        self._sync_advisories()

    @precondition(lambda self: bool(self.control))
    @rule()
    def control_signal(self) -> None:
        """The control subject reaches the runners (what `Runner._on_control` does)."""
        run_ids, self.control = self.control, []
        doc = self.run(self.raw.get_run(self.run_id))
        for svc in self.runners:
            for run_id in run_ids:
                cancel = svc.executions.get(run_id)
                if cancel is not None and doc.cancel_requested:
                    cancel.cancel(CancelReason.OPERATOR)
                    _seen("control signal")

    @precondition(lambda self: self.pending_record is not None)
    @rule(lands=st.booleans())
    def launch_record(self, lands: bool) -> None:
        """The launch's publication record, written after the launch returned, lands now — or
        never (the producer died first): the claim records its own delivery, and the sweeper's
        missing-publication rule republishes under the original `Nats-Msg-Id`, which the
        dedupe window answers as the same copy. Neither strands nor doubles the run."""
        pending, self.pending_record = self.pending_record, None
        assert pending is not None
        if lands:
            # Through the batch's read, as the publisher writes it: skipped when the claim
            # recorded the copy first (the case the record's CAS would refuse).
            written = self.run(self.ops.publisher.launch_records.write_needed([pending]))
            _seen("launch record: landed late" if written else "launch record: claim was first")
        else:
            _seen("launch record: never written")

    @rule()
    def consumer_leader_change(self) -> None:
        """The work consumer's leader changes (a 3-node cluster, issue 21): a message
        redelivered less than `ack_wait` ago and not working-acked since is deliverable again
        at once (`WorkQueue.consumer_leader_change`, pinned by the broker contract tests)."""
        if self.queue.consumer_leader_change():
            _seen("consumer leader change: an early redelivery")

    @precondition(lambda self: len(set(self.queue.sequences()) - set(self.hostile)) < 3)
    @rule()
    def duplicate(self) -> None:
        """The broker holds a second copy of the current attempt (another msg id)."""
        doc = self.last_doc
        body, headers = encode(
            RunMessage(
                run_id=doc.run_id,
                tenant=doc.tenant,
                attempt=doc.attempt,
                kind="resume",
                published_at=self.now(),
            )
        )
        self._serial += 1
        headers[HDR_MSG_ID] = f"{doc.run_id}:{doc.attempt}:dup{self._serial}"
        self.queue.publish(NAMES.runs_subject, body, headers)
        _seen("duplicate copy")

    @precondition(lambda self: self.fault is None)
    @rule(kind=st.sampled_from(["fail", "lost_ack"]))
    def publish_fault(self, kind: str) -> None:
        """The next publish fails: before the server stored it, or its PubAck is lost."""
        self.fault = kind

    # -- rules: operators, the backstop and the sweeper ----------------------------------------

    def _operators(self) -> int:
        return sum(1 for a in self.actors if a.kind in ("publisher", "rewind"))

    @precondition(lambda self: self._operators() < 2)
    @rule(
        kind=st.sampled_from(["resume", "resume", "resume", "rewind", "cancel", "replay"]),
        node_id=st.sampled_from(NODES),
        no_answers=st.booleans(),
        source=st.sampled_from([None, None, "v2-forced", "v2"]),
        accept_scratch_loss=st.booleans(),
        raise_budget=st.booleans(),
    )
    def operator(
        self,
        kind: str,
        node_id: str,
        no_answers: bool,
        source: str | None,
        accept_scratch_loss: bool,
        raise_budget: bool,
    ) -> None:
        """An operator resumes (with answers, consents, a raised cap), cancels, rewinds, or
        replays the DLQ record of the run."""
        pub = self.ops.publisher
        doc = self.last_doc
        coro: Coroutine[Any, Any, Any]
        if kind == "resume":
            used = doc.checkpoint.usage.iterations if doc.checkpoint else 0
            request = ResumeRequest(
                answers={} if no_answers else {"go": True},
                force=source == "v2-forced",
                accept_scratch_loss=accept_scratch_loss,
                budget=Budget(max_iterations=used + 6) if raise_budget else None,
                new_source=V2 if source else None,
            )
            coro = pub.resume(self.run_id, request, tenant="default")
        elif kind == "cancel":
            coro = pub.cancel(self.run_id, tenant="default", skew=timedelta(seconds=SKEW))
        elif kind == "rewind":
            coro = rewind(self.store, self.run_id, node_id, skew_s=SKEW)  # type: ignore[arg-type]
        else:
            records = sorted(self.dlq.records.values(), key=lambda r: (r.run_id is None, r.id))
            if not records:
                return
            coro = pub.replay(records[0].id, tenant="default")
        self._start(Actor(f"op:{kind}", "rewind" if kind == "rewind" else "publisher"), coro)

    def _advisory_ready(self) -> AdvisoryState | None:
        return next(
            (
                a
                for a in self.advisories
                if not a.done and not a.inflight and a.available_at <= self.clock.now
            ),
            None,
        )

    @precondition(lambda self: self._advisory_ready() is not None)
    @rule()
    def backstop(self) -> None:
        """The backstop takes the next MAX_DELIVERIES advisory (its consumer redelivers one
        that is neither acked nor nak'd within its ack_wait)."""
        state = self._advisory_ready()
        assert state is not None
        actor, coro = self._backstop(state)
        self._start(actor, coro)

    def _backstop(self, state: AdvisoryState) -> tuple[Actor, Coroutine[Any, Any, None]]:
        state.inflight = True
        state.available_at = self.clock.now + ADVISORY_ACK_WAIT
        actor = Actor(f"ops:backstop s{state.seq}", "backstop")
        actor.hostile = state.data is not None

        def released() -> None:
            state.inflight = False

        actor.on_done = released
        backstop = Backstop(self.ops)

        async def settle() -> None:
            verdict = await backstop.settle_advisory(AdvisoryMsg(self, state))  # type: ignore[arg-type]
            _seen(f"backstop:{verdict}")

        return actor, settle()

    @precondition(lambda self: not any(a.kind == "sweeper" for a in self.actors))
    @rule()
    def sweep(self) -> None:
        """One sweeper pass."""
        sweeper = Sweeper(self.ops)

        async def sweep() -> None:
            report = await sweeper.sweep_once(force=True)
            for action in report.actions:
                _seen(f"sweeper:{action}")

        self._start(Actor("ops:sweep", "sweeper"), sweep())

    # -- after every step ------------------------------------------------------------------------

    @invariant()
    def protocol_holds(self) -> None:
        self.steps += 1  # once after the setup, then once after every step
        self._reap()
        doc = self.run(self.raw.get_run(self.run_id))
        self.last_doc = doc
        prev = self.prev_doc
        if doc.attempt < prev.attempt:
            self.violation("attempt_decreased", f"{prev.attempt} -> {doc.attempt}")
        if prev.checkpoint is not None:
            a = prev.checkpoint.usage
            b = doc.checkpoint.usage if doc.checkpoint else None
            if b is None or b.iterations < a.iterations or b.cost_usd < a.cost_usd:
                self.violation("usage_decreased", f"{a} -> {b}")
        self.prev_doc = doc
        assert not self.violations, "\n".join(self.violations)

    def teardown(self) -> None:
        try:
            if not self.violations:
                self._no_orphan()
        finally:
            self._close()
        assert not self.violations, "\n".join(self.violations)

    def _no_orphan(self) -> None:
        """(5) Every actor crashes. Once ack_wait, the sweeper's grace and its interval have
        passed, what is left of the hostile bodies is delivered (each must end `malformed`),
        the backstop settles every advisory waiting for it, and one sweeper pass runs: the run
        must then be settled or have a message on its way, and never be left `queued`,
        `running` or auto-resumable behind a DLQ record of its attempt."""
        for actor in list(self.actors):
            self._cancel(actor)
            if actor.on_done is not None:
                actor.on_done()
        self.actors.clear()
        self.fault = None  # a publish fault is a moment; this pass publishes
        self.faults.clear()
        self.clock.advance(ACK_WAIT + SWEEPER_GRACE + SWEEPER_INTERVAL)
        self.queue.deliverable()
        self._sync_advisories()
        fresh = self._services("runner-end")
        for seq in self.queue.deliverable():
            if seq in self.hostile:
                self._drive_to_end(self._deliver_to(fresh, None, self.queue.deliver(seq)))
        self.queue.deliverable()
        self._sync_advisories()
        for _ in range(20):
            ready = self._advisory_ready()
            if ready is None:
                break
            self._drive(*self._backstop(ready))
        self._drive(Actor("end:sweep", "sweeper"), Sweeper(self.ops).sweep_once(force=True))
        self.queue.deliverable()
        self._sync_advisories()
        self._hostile_accounted()
        doc = self.run(self.raw.get_run(self.run_id))
        if not _orphanable(doc):
            return
        carriers = []
        for seq in self.queue.sequences():
            if seq in self.hostile:
                continue
            state = self.queue.state(seq)
            message = decode(self.queue.get_msg(seq).data or b"")
            if message.attempt != doc.attempt:
                continue
            advised = any(a.seq == seq and not a.done for a in self.advisories)
            if state in ("waiting", "pending") or advised:
                carriers.append((seq, state))
        _seen("end: a message carries the run" if carriers else "end: orphan")
        if carriers:
            return
        behind = [
            r
            for r in self.dlq.records.values()
            if r.run_id == self.run_id and r.attempt == doc.attempt
        ]
        if behind:
            self.violation(
                "left_behind_record",
                f"run {doc.status} {doc.failure_code} attempt {doc.attempt} stands behind"
                f" DLQ record(s) {[(r.id, r.reason) for r in behind]} after the backstop and"
                " the sweeper had their turn",
            )
            return
        self.violation(
            "orphan",
            f"run {doc.status} {doc.failure_code} attempt {doc.attempt} publication"
            f" {doc.publication} has no message on its way after the sweeper's grace",
        )

    def _drive_to_end(self, actor: Actor) -> None:
        for _ in range(10_000):
            if not actor.parked:
                break
            self._grant(actor)
        self._reap()
        assert actor.done, f"{actor.name} did not end"

    def _hostile_accounted(self) -> None:
        """(§13.12) Every hostile body ended as a `malformed` record and left the stream; every
        hostile advisory was acked."""
        for seq, kind in self.hostile.items():
            record = self.dlq.records.get(seq)
            state = self.queue.state(seq)
            if record is None or record.reason != "malformed" or state != "gone":
                self.violation(
                    "hostile_unaccounted",
                    f"hostile {kind} s{seq}: record {record and record.reason}, message {state}",
                )
        for adv in self.advisories:
            if adv.data is not None and not adv.done:
                self.violation("hostile_advisory_left", f"{adv.data[:40]!r} was never acked")

    def _close(self) -> None:
        try:
            for actor in list(self.actors):
                if not actor.done:
                    self._cancel(actor)
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.run(asyncio.wait(pending))
            self.run(self.raw.close())
            self.run(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()
            logging.getLogger().removeHandler(self._log)
            for obj, name, original in reversed(self._patches):
                setattr(obj, name, original)
            shutil.rmtree(self.tmp, ignore_errors=True)
            COVERAGE.update(self.seen)
            COVERAGE["examples"] += 1
            STEPS_TAKEN[0] += max(self.steps - 1, 0)
            bookkeeping._MODEL = None
