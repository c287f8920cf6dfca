"""Every write an execution makes, with the conditions of SPEC §2 (invariant §13.1, ADR-0006).

- status and checkpoint writes: `lease.token == mine ∧ attempt == lease.attempt` (plus the status
  expected; a status other than `finished` also needs `cancel_requested` unset — on that conflict
  the writer re-reads and writes `cancelled` instead);
- record-field writes (`scratch`, `metrics`) and the plain release: `lease.token == mine` only.

A conflict whose re-read shows another token (or no lease) means the lease is lost: the writer
raises `LeaseLost`, signals the execution, and refuses every later write without touching the
store, so a stale execution cannot write even if the store would let it.

Every write carries the events it describes, and whatever narration the execution deferred
(`EventLog.defer`), in the same store operation: a refused write appends none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.cancel import CancelSignal
from engine.outcome import CancelReason
from store import (
    CasConflict,
    Checkpoint,
    Condition,
    Eq,
    EventDraft,
    RunDocument,
    RunfleetError,
    RunStatus,
    RunStore,
    Update,
)

if TYPE_CHECKING:
    from engine.events import EventLog


class LeaseLost(RunfleetError, code="lease_lost"):
    """The execution no longer holds the run's lease: it must write nothing more."""


class FencedWriter:
    def __init__(
        self, store: RunStore, run_id: str, token: str, attempt: int, cancel: CancelSignal
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.token = token
        self.attempt = attempt
        self.cancel = cancel
        self.events: EventLog | None = None
        """The execution's log, whose deferred narration rides with each write (set by the
        execution that owns both)."""
        self.release_sent = False
        """A status write carried the release: if its reply was lost, the lease is gone because
        this execution dropped it, not because an adopter took it (`release`)."""
        self.on_release: Callable[[], None] | None = None
        """Told just before a status write that also drops the lease: the lease keeper stops,
        so its next beat does not mistake the release for a lost lease."""
        self._checkpoint: dict[str, Any] | None = None
        """A checkpoint not yet written (`_hold`): the next fenced state write carries it."""
        self._says: list[EventDraft] = []
        """What describes `_checkpoint` (a node's `node_finished`, and the narration said
        before it): it lands in the write that carries the checkpoint, or not at all."""

    def _hold(self, checkpoint: Checkpoint, events: Sequence[EventDraft] = ()) -> None:
        """Keep `checkpoint` until a write lands it, with everything said so far and `events`.
        A write that raises (a store error) keeps them held, and the next fenced write — the
        outcome's status, or the release's checkpoint — carries them together: `node_finished`
        never lands without the checkpoint that completes its node, and no later event (an
        `emit` during teardown) flushes it on its own. Otherwise a resume re-runs a node the
        log says finished (SPEC §13.6; found by the chaos soak's store-fault window)."""
        said = self.events.take() if self.events is not None else []
        self._checkpoint = checkpoint.model_dump()
        self._says = [*self._says, *said, *events]

    def _carry(self, fields: dict[str, Any]) -> list[EventDraft]:
        """Put the held checkpoint into `fields`; the events that ride first with it."""
        if self._checkpoint is None:
            return []
        fields["checkpoint"] = self._checkpoint
        return list(self._says)

    def _drop_held(self) -> None:
        """The held checkpoint landed, or a write of it was refused (the run moved on)."""
        self._checkpoint = None
        self._says = []

    def defer_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The run's last node boundary, when its outcome's status write follows at once
        (nothing to tear down): the checkpoint rides with that write. Status and checkpoint
        writes share one fence (SPEC §2), so the pair lands or is refused as one; a crash
        before it re-runs the last node, as one a moment earlier would (§6.2: at-least-once).
        ADR-0014 amendment 1 (issue 19: one write fewer per run)."""
        self._hold(checkpoint)

    async def _write_held_checkpoint(self) -> None:
        """A write fenced by token only never carries a checkpoint (SPEC §2): a held one is
        written on its own first. The path a run takes here is a status write that raised
        (a store error): the release that follows first saves the last node's work, if the
        lease is still ours. If it is not, the conflict marks the lease lost and the caller's
        own write meets the same conflict and says so (`release` answers None: found by the
        protocol model, a nak sent on an adopter's delivery)."""
        if self._checkpoint is not None:
            try:
                await self._write_checkpoint({})
            except LeaseLost:
                return

    async def _write(
        self,
        conditions: Sequence[Condition],
        update: Update,
        events: Sequence[EventDraft] = (),
        *,
        held: Sequence[EventDraft] = (),
    ) -> RunDocument | CasConflict:
        """One fenced write with `held` (what describes the checkpoint it carries), the pending
        narration and `events`, in that order: inside it when the log rides (a write that
        raises gives the pending narration back for the next write; a refused one drops it, as
        a lost lease appends nothing), else appended right after it lands."""
        log = self.events
        if log is None:
            return await self.store.update_run(
                self.run_id, conditions, update, events=[*held, *events]
            )
        if not log.rides:
            result = await self.store.update_run(self.run_id, conditions, update)
            if not isinstance(result, CasConflict):
                if held:  # handed to the log now: an append that fails keeps them there only
                    self._says = []
                log.give_back(list(held))
                await log.flush(*events)
            return result
        pending = log.take()
        drafts = [*held, *pending, *events]
        try:
            result = await self.store.update_run(self.run_id, conditions, update, events=drafts)
        except BaseException:
            log.give_back(pending)
            raise
        if not isinstance(result, CasConflict):
            log.rode(drafts)
        return result

    @property
    def lost(self) -> bool:
        return self.cancel.reason is CancelReason.LEASE_LOST

    def _guard(self) -> None:
        if self.lost:
            raise LeaseLost(f"run {self.run_id}: lease {self.token} lost; write refused")

    def _fence(self) -> list[Eq]:
        return [Eq("lease.token", self.token), Eq("attempt", self.attempt)]

    def _judge(self, conflict: CasConflict) -> RunDocument:
        """Re-judge a conflict: a lease that is no longer ours is lost; anything else is the
        caller's to decide on the returned document."""
        current = conflict.current
        if current is None or current.lease is None or current.lease.token != self.token:
            self.cancel.cancel(CancelReason.LEASE_LOST)
            raise LeaseLost(f"run {self.run_id}: lease {self.token} is no longer held")
        if current.attempt != self.attempt:
            self.cancel.cancel(CancelReason.LEASE_LOST)
            raise LeaseLost(f"run {self.run_id}: attempt moved to {current.attempt}")
        return current

    async def write_checkpoint(
        self,
        checkpoint: Checkpoint,
        extra: Mapping[str, Any] | None = None,
        *,
        events: Sequence[EventDraft] = (),
    ) -> RunDocument:
        """Write a node boundary, with `events` (and what was said before it) riding on it. A
        write that raises keeps all of it held for the next fenced write (`_hold`)."""
        self._guard()
        self._hold(checkpoint, events)
        return await self._write_checkpoint(dict(extra or {}))

    async def _write_checkpoint(self, fields: dict[str, Any]) -> RunDocument:
        held = self._carry(fields)
        result = await self._write(
            [*self._fence(), Eq("status", RunStatus.RUNNING)], Update(set=fields), held=held
        )
        self._drop_held()  # landed, or refused: the run moved on without it
        if isinstance(result, CasConflict):
            current = self._judge(result)
            raise LeaseLost(f"run {self.run_id}: checkpoint refused in status {current.status}")
        return result

    async def write_status(
        self,
        status: RunStatus,
        *,
        failure_code: str | None = None,
        error: str | None = None,
        cause_code: str | None = None,
        extra: Mapping[str, Any] | None = None,
        events: Sequence[EventDraft] = (),
        release: bool = False,
    ) -> RunDocument:
        """Write the outcome status, with `events` (the status's own event first) riding on it.
        Returns the written document: its status is `cancelled` when a pending operator cancel
        beat the outcome (SPEC §5.6) — then `run_cancelled` rode instead of `events`.

        `release`: drop the lease in the same write. Only when the teardown has nothing to do
        (no sandbox started, no scratch to bank or drop): §5.4 orders the release after the
        teardown, and an empty teardown keeps that order (ADR-0014)."""
        self._guard()
        conds = [*self._fence(), Eq("status", RunStatus.RUNNING)]
        if status is not RunStatus.FINISHED:
            conds.append(Eq("cancel_requested", False))
        fields: dict[str, Any] = {
            "status": status,
            "failure_code": failure_code,
            "error": error,
            "cause_code": cause_code,
            **(extra or {}),
        }
        held = self._carry(fields)
        if release:
            self.release_sent = True
            if self.on_release is not None:
                self.on_release()
        update = Update(set=fields, unset=["lease"] if release else [])
        result = await self._write(conds, update, events, held=held)
        if not isinstance(result, CasConflict):
            self._drop_held()
            return result
        current = self._judge(result)
        if current.cancel_requested and current.status is RunStatus.RUNNING:
            return await self.write_cancelled(release=release)  # the held checkpoint rides
        self._drop_held()
        raise LeaseLost(f"run {self.run_id}: status write refused in status {current.status}")

    async def write_cancelled(self, *, release: bool = False) -> RunDocument:
        """`running → cancelled`, with `run_cancelled` riding on it."""
        self._guard()
        fields: dict[str, Any] = {
            "status": RunStatus.CANCELLED,
            "cancel_requested": False,
            "failure_code": None,
            "error": None,
        }
        held = self._carry(fields)
        result = await self._write(
            [*self._fence(), Eq("status", RunStatus.RUNNING)],
            Update(set=fields, unset=["lease"] if release else []),
            [EventDraft("run_cancelled", {}, self.attempt, self.token)],
            held=held,
        )
        self._drop_held()
        if isinstance(result, CasConflict):
            self._judge(result)
            raise LeaseLost(f"run {self.run_id}: cancel write refused")
        return result

    async def write_record(
        self, fields: Mapping[str, Any], *, events: Sequence[EventDraft] = ()
    ) -> RunDocument:
        """Record fields (`scratch`, `metrics`), with `events` riding: fenced by token only, so
        a resume queued while this execution still banks does not fence out its bank record."""
        self._guard()
        await self._write_held_checkpoint()
        result = await self._write(
            [Eq("lease.token", self.token)], Update(set=dict(fields)), events
        )
        if isinstance(result, CasConflict):
            self._judge(result)
            raise LeaseLost(f"run {self.run_id}: record write refused")
        return result

    async def release(self) -> RunDocument | None:
        """Drop the lease (token only). None when it was already gone: nothing to release."""
        if self.lost:
            return None
        await self._write_held_checkpoint()
        result = await self._write([Eq("lease.token", self.token)], Update(unset=["lease"]))
        if not isinstance(result, CasConflict):
            return result
        current = result.current
        if self.release_sent and current is not None and current.lease is None:
            return current  # our status write dropped it; its reply was lost
        return None
