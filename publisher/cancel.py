"""Cancel (SPEC §4): a CAS on the store, and — only for a run whose lease is live — a signal on
its control subject so the execution checkpoints and stops at once. The signal is best effort
(the lease refresh reads `cancel_requested` anyway), so a cancel needs NATS for nothing: with
no connection it is the same CAS, and the refresh carries it to the running execution (found
by an operator walkthrough: cancelling a `failed_resumable` run needed NATS, exit 4).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

from publisher.errors import RunNotCancellable
from store import (
    CasConflict,
    Eq,
    LeaseFree,
    RunDocument,
    RunNotFound,
    RunStatus,
    RunStore,
    Update,
    lease_is_free,
    utcnow,
)

Signal = Callable[[str], Awaitable[None]]
"""Tells the execution of run `run_id` to stop now (the control subject); best effort."""

CANCELLABLE_DIRECTLY = frozenset(
    {
        RunStatus.QUEUED,
        RunStatus.PAUSED_WAITING_HUMAN,
        RunStatus.PAUSED_OPERATOR,
        RunStatus.FAILED_RESUMABLE,
    }
)


async def cancel_run(
    store: RunStore, run_id: str, *, tenant: str, skew: timedelta, signal: Signal | None
) -> RunDocument:
    run = await store.get_run(run_id)
    if run.tenant != tenant:
        raise RunNotFound(f"no run {run_id!r}")  # another tenant's run does not exist here
    now = utcnow()
    if run.status in CANCELLABLE_DIRECTLY:
        result = await store.update_run(
            run_id,
            [Eq("status", run.status), Eq("attempt", run.attempt)],
            Update(set={"status": RunStatus.CANCELLED, "cancel_requested": False}),
        )
    elif run.status is RunStatus.RUNNING and not lease_is_free(run, now, skew):
        result = await store.update_run(
            run_id,
            [Eq("status", RunStatus.RUNNING), Eq("attempt", run.attempt)],
            Update(set={"cancel_requested": True}),
        )
        if not isinstance(result, CasConflict):
            if signal is not None:
                await signal(run_id)
            return result
    elif run.status is RunStatus.RUNNING:
        result = await store.update_run(
            run_id,
            [Eq("status", RunStatus.RUNNING), Eq("attempt", run.attempt), LeaseFree(now, skew)],
            Update(set={"status": RunStatus.CANCELLED, "cancel_requested": False}, unset=["lease"]),
        )
    else:
        raise RunNotCancellable(f"run {run_id} is {run.status}")
    if isinstance(result, CasConflict):  # re-read, re-judge
        return await cancel_run(store, run_id, tenant=tenant, skew=skew, signal=signal)
    await store.append_event(run_id, "run_cancelled", {"by": "operator"}, attempt=run.attempt)
    return result
