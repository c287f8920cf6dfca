"""The world as the product sees it, and the execution's parts the model replaces.

The world: the real `SqliteRunStore` on the loop's thread (`InlineWorker`), gated and judged
per operation (`WatchedStore`); the JetStream calls, the messages, the DLQ store and core NATS
on the broker double of `broker.py`; a sandbox driver whose sandboxes run nothing; the real
filesystem blob store. Each operation first waits at its actor's gate (`actors.py`), and a
fault the machine armed (`faults.py`) may fire there.

The execution: `runner.delivery` builds `ModelEventLog`, `ModelExecution` and (through the real
`HeldLease`) `ModelLeaseKeeper` in place of theirs, and calls `_judge` and `_model_dispose` —
the real `judge` and `dispose_outcome`, noted on the way; `engine.execution` loads the stored
workflow through `_model_load`. The machine installs them (`ProtocolModel._patch_all`)."""

from __future__ import annotations

import base64
import contextlib
import contextvars
import io
import json
import sqlite3
import tarfile
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats.errors
from hypothesis import strategies as st
from nats.js.api import PubAck, RawStreamMsg

import engine.loader
import runner.admission
import runner.disposition
from engine.events import EventLog
from engine.execution import Execution
from engine.fencing import LeaseLost
from engine.lease import LeaseKeeper
from engine.outcome import CancelReason, Finished, Interrupted, Outcome
from engine.sandbox.errors import SandboxCopyFailed, SandboxLost, SandboxStartFailed
from engine.sandbox.protocols import SandboxCapabilities, SandboxSpec
from publisher.dlq import DlqRecord
from publisher.errors import RecordNotFound
from publisher.wire import HDR_MSG_ID, RunMessage
from runner.admission import Ack, Dead, Decision, Nak
from runner.deliveries import Delivery
from runner.disposition import Plan
from runner.services import RunnerServices
from store import (
    CasConflict,
    Condition,
    Event,
    EventDraft,
    RunDocument,
    ScratchRecord,
    Update,
)
from store.blobs_fs import FilesystemBlobStore
from store.protocols import BlobInfo
from store.sqlite import SqliteRunStore
from tests.model import bookkeeping
from tests.model.actors import ACTOR, AdvisoryState, Live, gate
from tests.model.bookkeeping import _current, _seen
from tests.model.broker import Delivered, StreamInfoApi
from tests.model.faults import (
    ADMISSION,
    BACKSTOP,
    LOST_REPLY,
    ModelFault,
    outage,
    write_point,
)

if TYPE_CHECKING:
    from tests.model.machine import ProtocolModel

APPEND_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "model_append_deadline", default=None
)

SCRATCH = [None, "unbankable", "banked", "empty", "gone"]
"""A teardown's drawn bank record; "gone" is a banked record whose archive is missing."""


# -- the world as the product sees it ----------------------------------------------------------


class InlineWorker:
    """Runs the store's operations on the loop's thread, each write in its own transaction.
    `SqliteRunStore` normally hands them to its own thread (`SqliteWorker`, with group commit);
    here one actor runs at a time anyway, and a thread hop per operation (about a millisecond
    on these machines) would be most of an example's time. The SQL and the CAS are the store's
    own."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    async def read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return fn(self._conn)

    async def write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(self._conn)
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        return result

    async def close(self) -> None:
        self._conn.close()


class _Abandoned(Exception):
    """An event append whose lease time ran out before it reached the store."""


class WatchedStore:
    """The real `SqliteRunStore`, gated per operation; every successful write is judged."""

    def __init__(self, inner: SqliteRunStore, model: ProtocolModel) -> None:
        self.inner = inner
        self.model = model

    def _fault(self, point: str | None) -> bool | None:
        """None: no fault here. Else the fault fires: True when its reply is lost (the
        operation lands first), False when it never reaches the store."""
        if point is None or not self.model.take_fault(point):
            return None
        return self.model.lost_reply.get(point, False) and point in LOST_REPLY

    def _error(self, point: str, what: str) -> BaseException:
        if point == BACKSTOP:
            return ModelFault(f"model: the backstop met an unexpected error ({what})")
        return self.model.inject(outage(what))

    async def get_run(self, run_id: str) -> RunDocument:
        await gate("get_run")
        point = _store_point(None)
        if point is not None and self._fault(point) is not None:
            raise self._error(point, f"get_run {run_id}")
        doc = await self.inner.get_run(run_id)
        actor = ACTOR.get()
        if actor is not None and actor.kind == "sweeper":
            actor.reads[run_id] = doc
        return doc

    async def update_run(
        self,
        run_id: str,
        conditions: list[Condition],
        update: Update,
        *,
        events: Sequence[EventDraft] = (),
    ) -> RunDocument | CasConflict:
        await gate(f"update_run {_describe(update)}")
        point = _store_point(update)
        lost = self._fault(point)
        if point is not None and lost is False:
            raise self._error(point, _describe(update))
        pre = await self.inner.get_run(run_id)
        seen = len(await self.inner.read_events(run_id, 0, 100_000)) if events else 0
        result = await self.inner.update_run(run_id, conditions, update, events=events)
        if not isinstance(result, CasConflict):
            self.model.on_write(ACTOR.get(), pre, list(conditions), update, result)
            # The events that rode with the write are judged like appended ones (issue 19).
            for ev in await self.inner.read_events(run_id, seen, 100_000) if events else []:
                self.model.on_event(ACTOR.get(), ev, result)
        if point is not None and lost:
            raise self._error(point, f"reply lost: {_describe(update)}")
        return result

    async def append_event(
        self, run_id: str, type: str, data: dict[str, Any] | None = None, **kw: Any
    ) -> Event:
        await gate(f"append_event {type}")
        deadline = APPEND_DEADLINE.get()
        if deadline is not None and self.model.clock.now > deadline:
            raise _Abandoned(type)
        point = "run_claimed" if type == "run_claimed" else _store_point(None, event=True)
        lost = self._fault(point)
        if lost is False:
            raise self.model.inject(outage(f"append {type}"))
        ev = await self.inner.append_event(run_id, type, data, **kw)
        self.model.on_event(ACTOR.get(), ev, await self.inner.get_run(run_id))
        if lost:
            raise self.model.inject(outage(f"reply lost: append {type}"))
        return ev

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        await gate("read_events")
        return await self.inner.read_events(run_id, after_seq, limit)

    async def read_events_before(
        self, run_id: str, before_seq: int | None = None, limit: int = 1000
    ) -> list[Event]:
        await gate("read_events")
        return await self.inner.read_events_before(run_id, before_seq, limit)

    async def put_interaction(self, interaction: Any) -> Any:
        await gate("put_interaction")
        return await self.inner.put_interaction(interaction)

    async def retire_interactions(self, run_id: str) -> int:
        await gate("retire_interactions")
        return await self.inner.retire_interactions(run_id)

    async def list_runs(self, query: Any) -> Any:
        await gate("list_runs")
        page = await self.inner.list_runs(query)
        actor = ACTOR.get()
        if actor is not None:
            actor.reads.update({run.run_id: run for run in page.runs})
        return page

    async def list_run_copies(self, query: Any) -> Any:
        await gate("list_run_copies")
        return await self.inner.list_run_copies(query)

    async def try_lock(self, name: str, owner: str, now: datetime, ttl_s: float) -> bool:
        await gate("try_lock")
        return await self.inner.try_lock(name, owner, now, ttl_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _store_point(update: Update | None, *, event: bool = False) -> str | None:
    """Which fault point a delivery's store operation is at (None: not a fault point)."""
    actor = ACTOR.get()
    if actor is not None and actor.kind == "backstop":
        return BACKSTOP if update is not None else None
    if actor is None or actor.kind != "delivery" or actor.delivery is None:
        return None
    if not actor.delivery.leased:
        return ADMISSION
    live = actor.live
    after_engine = live is not None and live.outcome is not None
    if update is not None and not after_engine:
        boundary = "checkpoint" in update.set and "status" not in update.set
        return "checkpoint" if boundary and live is not None else None
    if update is not None:
        return write_point(update)
    if not after_engine:
        return None
    return "event" if event else "park_read"  # the only read after the engine: `_park`'s


def _describe(update: Update) -> str:
    parts = [f"{k}={v}" for k, v in update.set.items() if k in ("status", "attempt")]
    parts += [k for k in update.set if k not in ("status", "attempt")]
    parts += [f"-{k}" for k in update.unset]
    return " ".join(parts)


class ModelJetStream:
    """The `JetStreamContext` calls the product makes, on the double, gated. A publish may be
    made to fail (before the server stored it, or with its PubAck lost)."""

    def __init__(self, model: ProtocolModel) -> None:
        self.model = model

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 - nats-py's signature
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> PubAck:
        await gate(f"publish {(headers or {}).get(HDR_MSG_ID)}")
        self.model.on_publish(ACTOR.get(), payload)
        fault, self.model.fault = self.model.fault, None
        if fault == "fail":
            raise nats.errors.TimeoutError
        ack = self.model.queue.publish(subject, payload, headers)
        if fault == "lost_ack":
            raise nats.errors.TimeoutError
        return ack

    async def get_msg(self, stream: str, seq: int | None = None, **_: Any) -> RawStreamMsg:
        await gate(f"get_msg {seq}")
        assert seq is not None
        return self.model.queue.get_msg(seq)

    async def delete_msg(self, stream: str, seq: int) -> bool:
        await gate(f"delete_msg {seq}")
        return self.model.queue.delete_msg(seq)


class ModelMsg:
    """The `nats.aio.msg.Msg` inside the real `runner.deliveries.Delivery`, on the double."""

    def __init__(self, model: ProtocolModel, delivered: Delivered) -> None:
        self.model = model
        self.d = delivered
        self.data = delivered.data
        self.headers = delivered.headers

    async def ack(self) -> None:
        await gate(f"ack s{self.d.seq}#{self.d.num_delivered}")
        self.model.on_disposition(ACTOR.get(), self.d, "ack", None)
        self.d.ack()

    async def ack_sync(self, timeout: float = 1.0) -> None:  # noqa: ASYNC109 - nats-py's
        await self.ack()

    async def nak(self, delay: float | None = None) -> None:
        await gate(f"nak s{self.d.seq}#{self.d.num_delivered} {delay}")
        self.model.on_disposition(ACTOR.get(), self.d, "nak", delay)
        self.d.nak(delay)

    async def in_progress(self) -> None:
        await gate(f"in_progress s{self.d.seq}")
        self.d.in_progress()


class ModelDlq:
    """`publisher.dlq.DlqStore` on a dict: one record per dead sequence, a rewrite replaces."""

    def __init__(self, model: ProtocolModel) -> None:
        self.model = model
        self.records: dict[int, DlqRecord] = {}

    async def put(self, *, seq: int, reason: str, **kw: Any) -> DlqRecord:
        await gate(f"dlq.put {seq} {reason}")
        body = kw.get("body", b"")
        record = DlqRecord(
            id=seq,
            headers=kw.get("headers", {}),
            body_b64=base64.b64encode(body).decode(),
            body_bytes=len(body),
            run_id=kw.get("run_id"),
            attempt=kw.get("attempt"),
            reason=reason,
            detail=kw.get("detail", "")[:200],
            num_delivered=kw.get("num_delivered", 0),
            runner=kw.get("runner", ""),
            at=self.model.now(),
            replayable=bool(kw.get("replayable", True)) and kw.get("run_id") is not None,
        )
        self.records[seq] = record
        _seen(f"dlq:{reason}")
        if (seq in self.model.hostile) != (reason == "malformed"):
            what = "a hostile body" if seq in self.model.hostile else "a valid message"
            self.model.violation("dlq_reason", f"{what} (s{seq}) recorded {reason}")
        if seq in self.model.hostile and record.replayable:
            self.model.violation("dlq_reason", f"hostile s{seq} recorded replayable")
        return record

    async def get(self, record_id: int) -> DlqRecord:
        await gate(f"dlq.get {record_id}")
        if record_id not in self.records:
            raise RecordNotFound(f"no DLQ record {record_id}")
        return self.records[record_id]

    async def delete(self, record_id: int) -> bool:
        await gate(f"dlq.delete {record_id}")
        return self.records.pop(record_id, None) is not None


class ModelNats:
    """Core NATS: the control subject's cancel signal, the sweeper's one stream-info request
    per pass, and the server's `max_payload` a resume checks its message against."""

    max_payload = 1024 * 1024  # nats-server's default, as INFO says it to a real client

    def __init__(self, model: ProtocolModel) -> None:
        self.model = model

    async def publish(self, subject: str, payload: bytes = b"", **_: Any) -> None:
        await gate(f"signal {subject}")
        self.model.control.append(subject.rsplit(".", 1)[-1])

    async def request(self, subject: str, payload: bytes = b"", **_: Any) -> Any:
        """The sweeper's stream-info request, answered by the double (`StreamInfoApi`)."""
        await gate(f"request {subject}")
        return await StreamInfoApi(self.model.queue).request(subject, payload)


class NullSandbox:
    """The sandbox a restore starts: nothing runs in it (the model's nodes never exec), and
    its scratch is the host directory the bank is extracted into."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.name = f"model-{spec.run_id[-8:]}-{spec.lease_token[:8]}"

    async def exec(self, command: str, **_: Any) -> Any:
        raise SandboxLost("model: nothing runs in the model's sandbox")

    async def copy_out(self, src: Path, dest_tar: Path, *, max_bytes: int | None = None) -> None:
        raise SandboxCopyFailed("model: the scratch is host-backed")

    async def copy_in(self, tar: Path, dest_dir: Path) -> None:
        raise SandboxCopyFailed("model: the scratch is host-backed")

    async def stop(self) -> None:
        return None


class NullDriver:
    """The model's workflow has only call, human and fail nodes, so a sandbox starts only to
    restore a banked scratch (SPEC §7.4). Its scratch is host-backed, as the local driver's is
    (the banks the model draws are its own); its start may be made to fail."""

    capabilities = SandboxCapabilities(
        process_isolated=True, host_backed_scratch=True, supports_dir_copy=False
    )

    async def start(self, spec: SandboxSpec) -> NullSandbox:
        if _current().take_fault("sandbox_start"):
            raise _current().inject(SandboxStartFailed("model: the sandbox did not start"))
        _seen("sandbox started for a restore")
        return NullSandbox(spec)

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        if _current().take_fault("stop_others"):
            raise ModelFault("model: the sandbox driver failed to list the run's sandboxes")
        return []

    async def list_sandboxes(self) -> list[Any]:
        return []


class ModelBlobs(FilesystemBlobStore):
    """The real filesystem blob store; a banked archive's read may be made to fail."""

    async def get_to_file(self, key: str, path: Path) -> BlobInfo:
        model = _current()
        if "/scratch/" in key and model.take_fault("bank_read"):
            raise model.inject(outage(f"bank read {key}"))
        return await super().get_to_file(key, path)


def _bank_archive() -> bytes:
    """A banked scratch as the bank writes it: a gzipped tar of one file."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"scratch\n"
        info = tarfile.TarInfo("notes.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class AdvisoryMsg:
    """One delivery of a MAX_DELIVERIES advisory to the backstop."""

    def __init__(self, model: ProtocolModel, state: AdvisoryState) -> None:
        self.model = model
        self.state = state
        self.data = (
            state.data if state.data is not None else json.dumps({"stream_seq": state.seq}).encode()
        )

    async def ack(self) -> None:
        await gate(f"advisory ack {self.state.seq}")
        self.state.done, self.state.inflight = True, False

    async def ack_sync(self, timeout: float = 1.0) -> None:  # noqa: ASYNC109 - nats-py's
        await self.ack()

    async def nak(self, delay: float | None = None) -> None:
        await gate(f"advisory nak {self.state.seq} {delay}")
        self.state.inflight = False
        self.state.available_at = self.model.clock.now + (delay or 0.0)


# -- the execution ---------------------------------------------------------------------------


class ModelEventLog(EventLog):
    """`EventLog` whose lease-bounded append is judged on the model's clock: the real one wraps
    the append in `wait_for(seconds_left)`, a real-time race the model decides instead."""

    async def emit(self, type: str, **data: Any) -> Event | None:
        deadline = self.deadline
        token = None
        if deadline is not None:
            left = deadline()
            if left <= 0:
                return None
            token = APPEND_DEADLINE.set(_current().clock.now + left)
        self.deadline = None
        try:
            return await super().emit(type, **data)
        except _Abandoned:
            return None
        finally:
            self.deadline = deadline
            if token is not None:
                APPEND_DEADLINE.reset(token)


class ModelExecution(Execution):
    """The real execution (`runner.delivery` builds it with `Execution.claimed`); its teardown
    banks what hypothesis draws (SPEC §7.3: a fenced record write, skipped when the run
    finished, the lease was lost, or `run()` never ran: nothing was started to bank), and its
    sandbox's stop may be made to fail."""

    outcome: Outcome | None = None

    async def begin(self, path: str, runner: str) -> None:
        _seen(f"claim:{path}")
        await super().begin(path, runner)

    async def run(self) -> Outcome:
        self.outcome = await super().run()
        return self.outcome

    async def teardown(self, *args: Any, **kwargs: Any) -> None:
        model = _current()
        if model.take_fault("teardown"):
            raise ModelFault("model: the sandbox's stop failed")
        await super().teardown(*args, **kwargs)
        if self.writer.lost or self.outcome is None or isinstance(self.outcome, Finished):
            return
        state = model.draw(st.sampled_from(SCRATCH))
        if state is None:
            return
        key = f"runs/{self.run_id}/scratch/{self.token}.tgz"
        if state == "banked":
            assert self.blobs is not None
            await self.blobs.put_bytes(key, _bank_archive())
        record = ScratchRecord(
            state="banked" if state == "gone" else state,
            key=key if state in ("banked", "gone") else None,
            bytes=0 if state == "empty" else 10,
            progress=self.checkpoint.progress,
            lease_token=self.token,
            at=model.now(),
        )
        with contextlib.suppress(LeaseLost):
            await self.writer.write_record({"scratch": record.model_dump()})
            _seen(f"scratch:{state}")


class ModelLeaseKeeper(LeaseKeeper):
    """The real `LeaseKeeper` that the real `HeldLease` builds, with the machine as its clock:
    `run()` (the loop that sleeps an interval in real time between beats) only waits to be
    stopped; the machine calls `refresh_once` and the `HeldLease`'s beat (`on_beat`, the
    working ack) when a beat happens. It tells the machine about the execution it keeps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        actor = ACTOR.get()
        assert actor is not None and actor.delivery is not None
        self.live = Live(actor, actor.runner or 0, self.token, self, actor.delivery)
        actor.live = self.live
        _current().executions[self.token] = self.live

    async def run(self) -> None:
        await self._stop.wait()

    def stop(self) -> None:
        super().stop()
        self.live.ended = True


_REAL_DISPOSE = runner.disposition.dispose_outcome


async def _model_dispose(
    svc: RunnerServices,
    delivery: Delivery,
    message: RunMessage,
    execution: Execution,
    events: EventLog,
    outcome: Outcome,
) -> Plan:
    """The real `dispose_outcome`; the machine notes the outcome it disposes of."""
    actor = ACTOR.get()
    live = actor.live if actor is not None else None
    if live is not None:
        live.outcome = outcome
    if (
        isinstance(outcome, Interrupted)
        and outcome.reason is CancelReason.DRAIN
        and isinstance(execution, ModelExecution)
        and execution.outcome is None
    ):
        _seen("claim won after the drain began: handed off before its first node")
    plan = await _REAL_DISPOSE(svc, delivery, message, execution, events, outcome)
    _seen(f"plan:{plan.action}:{plan.reason}")
    return plan


_REAL_LOAD = engine.loader.stored_workflow


def _model_load(text: str, filename: str) -> Any:
    """The run's stored workflow, parsed under the held lease; when the fault is armed it no
    longer loads (a deploy whose loader refuses it): the real loader's own error."""
    model = bookkeeping._MODEL
    if model is None or not model.take_fault("load"):
        return _REAL_LOAD(text, filename)
    try:
        _REAL_LOAD(text + "\nnodes: [unclosed\n", filename)
    except Exception as exc:
        model.injected.append(exc)
        raise
    raise AssertionError("the model's broken workflow source loaded")


_REAL_JUDGE = runner.admission.judge


def _judge(*args: Any) -> Decision:
    """The real `judge`, its verdict noted on the delivery's actor (invariant 2)."""
    decision = _REAL_JUDGE(*args)
    if isinstance(decision, Dead):
        verdict = f"dead:{decision.reason}"
    elif isinstance(decision, Ack | Nak):
        verdict = decision.reason
    else:
        verdict = type(decision).__name__
    actor = ACTOR.get()
    if actor is not None:
        actor.verdict = verdict
    _seen(f"verdict:{verdict}")
    return decision
