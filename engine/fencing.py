"""Every write an execution makes, with the conditions of SPEC §2 (invariant §13.1, ADR-0006).

- status and checkpoint writes: `lease.token == mine ∧ attempt == lease.attempt` (plus the status
  expected; a status other than `finished` also needs `cancel_requested` unset — on that conflict
  the writer re-reads and writes `cancelled` instead);
- record-field writes (`scratch`, `metrics`) and the plain release: `lease.token == mine` only.

A conflict whose re-read shows another token (or no lease) means the lease is lost: the writer
raises `LeaseLost`, signals the execution, and refuses every later write without touching the
store, so a stale execution cannot write even if the store would let it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.cancel import CancelSignal
from engine.outcome import CancelReason
from store import (
    CasConflict,
    Checkpoint,
    Eq,
    RunDocument,
    RunfleetError,
    RunStatus,
    RunStore,
    Update,
)


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
        self, checkpoint: Checkpoint, extra: Mapping[str, Any] | None = None
    ) -> RunDocument:
        self._guard()
        update = Update(set={"checkpoint": checkpoint.model_dump(), **(extra or {})})
        result = await self.store.update_run(
            self.run_id, [*self._fence(), Eq("status", RunStatus.RUNNING)], update
        )
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
    ) -> RunDocument:
        """Write the outcome status. Returns the written document: its status is `cancelled`
        when a pending operator cancel beat the outcome (SPEC §5.6)."""
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
        result = await self.store.update_run(self.run_id, conds, Update(set=fields))
        if not isinstance(result, CasConflict):
            return result
        current = self._judge(result)
        if current.cancel_requested and current.status is RunStatus.RUNNING:
            return await self.write_cancelled()
        raise LeaseLost(f"run {self.run_id}: status write refused in status {current.status}")

    async def write_cancelled(self) -> RunDocument:
        self._guard()
        result = await self.store.update_run(
            self.run_id,
            [*self._fence(), Eq("status", RunStatus.RUNNING)],
            Update(
                set={
                    "status": RunStatus.CANCELLED,
                    "cancel_requested": False,
                    "failure_code": None,
                    "error": None,
                }
            ),
        )
        if isinstance(result, CasConflict):
            self._judge(result)
            raise LeaseLost(f"run {self.run_id}: cancel write refused")
        return result

    async def write_record(self, fields: Mapping[str, Any]) -> RunDocument:
        """Record fields (`scratch`, `metrics`): fenced by token only, so a resume queued while
        this execution still banks does not fence out its bank record."""
        self._guard()
        result = await self.store.update_run(
            self.run_id, [Eq("lease.token", self.token)], Update(set=dict(fields))
        )
        if isinstance(result, CasConflict):
            self._judge(result)
            raise LeaseLost(f"run {self.run_id}: record write refused")
        return result

    async def release(self) -> RunDocument | None:
        """Drop the lease (token only). None when it was already gone: nothing to release."""
        if self.lost:
            return None
        result = await self.store.update_run(
            self.run_id, [Eq("lease.token", self.token)], Update(unset=["lease"])
        )
        return None if isinstance(result, CasConflict) else result
