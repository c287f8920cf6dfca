"""Local executions: `runfleet run FILE` and `runfleet resume RUN --local` (SPEC §5.3 "Local").

No queue: the local claim resumes and claims in one CAS on the `version` read with the lease
free, writing `attempt + 1`, `running`, a lease, the request's effects and `origin: local`. The
execution is then fenced and refreshed exactly like a fleet one; the sweeper never republishes
`local` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import uuid6

from engine import attachments
from engine.cancel import CancelSignal
from engine.events import EventLog
from engine.execution import EngineEnv, Execution
from engine.failures import is_auto_resumable
from engine.fencing import LeaseLost
from engine.lease import LeaseKeeper
from engine.loader import LoadedWorkflow
from engine.outcome import CancelReason
from engine.refusals import RunBusy
from engine.resume import ResumeRequest, claim_effects, judge_resume
from engine.settle import settle
from engine.vars import resolve_vars
from store import (
    Budget,
    CasConflict,
    Eq,
    Event,
    Lease,
    LeaseFree,
    Origin,
    ResumeSpec,
    RunDocument,
    RunStatus,
    StagedFile,
    Update,
    WorkflowRef,
    lease_is_free,
    utcnow,
)
from store.staging import StagingStore


def owner_name() -> str:
    """Who holds a lease, in-process or on a runner: `host:pid`, what an operator can find."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LocalInterrupt:
    """A person's stop (Ctrl-C) for the in-process executions of one command. It reaches the
    execution the way an operator cancel reaches a fleet one through the control subject
    (SPEC §5.8): the execution checkpoints, writes `cancelled` and releases its lease, so
    `resume --local` can continue the run at once instead of waiting out the lease. Asked
    before an execution started, that execution stops before its first node."""

    def __init__(self) -> None:
        self.requested = False
        self._signal: CancelSignal | None = None

    def request(self) -> None:
        self.requested = True
        if self._signal is not None:
            self._signal.cancel(CancelReason.OPERATOR)

    def watch(self, signal: CancelSignal) -> None:
        """Route the stop to `signal`, the execution that starts now."""
        self._signal = signal
        if self.requested:
            signal.cancel(CancelReason.OPERATOR)


@dataclass(frozen=True, slots=True)
class LocalEnv(EngineEnv):
    on_event: Callable[[Event], None] | None = None
    interrupt: LocalInterrupt | None = None


def new_run_id() -> str:
    return str(uuid6.uuid7())


async def run_local(
    env: LocalEnv,
    loaded: LoadedWorkflow,
    inputs: dict[str, Any],
    *,
    tenant: str = "default",
    run_id: str | None = None,
    attachments: Sequence[StagedFile] = (),
) -> RunDocument:
    """Create a `local` run already claimed (create-only, so nothing else can hold it) and
    execute it to its outcome. `attachments`: already promoted to `run_id` (SPEC §8), as a
    launch's are before its run exists."""
    resolve_vars(loaded.workflow, inputs)  # refuse bad --var values before anything is written
    now = utcnow()
    token = uuid.uuid4().hex
    budget = Budget.model_validate(loaded.workflow.budget.model_dump())
    doc = RunDocument(
        run_id=run_id or new_run_id(),
        attachments=list(attachments),
        tenant=tenant,
        origin=Origin.LOCAL,
        workflow=WorkflowRef(
            name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
        ),
        inputs=inputs,
        budget=budget,
        status=RunStatus.RUNNING,
        attempt=1,
        attempt_at=now,
        lease=Lease(
            owner=owner_name(),
            token=token,
            attempt=1,
            expires_at=now + env.settings.lease_timing().ttl,
        ),
        created_at=now,
        updated_at=now,
    )
    await env.store.create_run(doc)
    events = EventLog(env.store, doc.run_id, 1, token, listener=env.on_event)
    await events.emit("run_launched", workflow=loaded.workflow.name, origin="local")
    return await execute_claimed(env, doc)


async def claim_local(env: LocalEnv, run: RunDocument, request: ResumeRequest) -> RunDocument:
    """Judge the resume, then resume and claim in one CAS (version read ∧ lease free).

    A `running` run whose lease is free lost its execution (a crash): it is adopted from its
    checkpoint, with nothing to re-ask or refuse."""
    timing = env.settings.lease_timing()
    now = utcnow()
    if not lease_is_free(run, now, timing.skew):
        raise RunBusy(run.run_id)
    if run.status is RunStatus.RUNNING:
        spec = ResumeSpec(
            attempt=run.attempt + 1, prior_status=run.status, published_at=now, kind="local"
        )
    else:
        spec = judge_resume(run, request).model_copy(update={"kind": "local"})
    token = uuid.uuid4().hex
    attempt = run.attempt + 1
    answered = await _promote_uploaded_answers(
        env, run.model_copy(update={"attempt": attempt}), spec
    )
    fields: dict[str, Any] = {
        "status": RunStatus.RUNNING,
        "origin": Origin.LOCAL,
        "attempt": attempt,
        "attempt_at": now,
        "resume_spec": spec.model_dump(),
        "cancel_requested": False,
        "failure_code": None,
        "error": None,
        "cause_code": None,
        "lease": Lease(
            owner=owner_name(), token=token, attempt=attempt, expires_at=now + timing.ttl
        ).model_dump(),
        **claim_effects(run, spec),
        **answered,
    }
    result = await env.store.update_run(
        run.run_id,
        [Eq("version", run.version), Eq("status", run.status), LeaseFree(now, timing.skew)],
        Update(set=fields),
    )
    if isinstance(result, CasConflict):
        current = result.current
        if current is not None and not lease_is_free(current, utcnow(), timing.skew):
            raise RunBusy(run.run_id)
        # Something else changed the run between our read and our write: judge it again.
        fresh = await env.store.get_run(run.run_id)
        return await claim_local(env, fresh, request)
    events = EventLog(env.store, run.run_id, attempt, token, listener=env.on_event)
    await events.emit("run_resumed", from_status=str(run.status))
    return result


async def _promote_uploaded_answers(
    env: LocalEnv, run: RunDocument, spec: ResumeSpec
) -> dict[str, Any]:
    """A `file` answer staged by the operations (`resume --local --answer doc=@PATH`) becomes
    an attachment as it does through the queue (SPEC §6.4, §8): promoted before the CAS, and
    the run's `attachments` field for the CAS to write. A path answer, or no blob store, makes
    none (the answer keeps the path where the file is)."""
    if env.blobs is None or not attachments.uploaded_answers(run, spec):
        return {}
    staging = StagingStore(env.store, env.blobs)
    await attachments.promote_answers(staging, env.blobs, run, spec)
    return attachments.answer_attachments(run, spec)


async def resume_local(
    env: LocalEnv, run_id: str, request: ResumeRequest, *, auto_resume: int = 0
) -> RunDocument:
    """Resume in-process; with `auto_resume` N, re-claim up to N times while the outcome is an
    auto-resumable failure (the same table the fleet reads)."""
    run = await env.store.get_run(run_id)
    claimed = await claim_local(env, run, request)
    assert claimed.lease is not None
    doc = await execute_claimed(env, claimed)
    for _ in range(auto_resume):
        if env.interrupt is not None and env.interrupt.requested:
            break  # the person asked to stop: no re-claim, whatever the outcome raced to
        if doc.status is not RunStatus.FAILED_RESUMABLE or not is_auto_resumable(doc.failure_code):
            break
        claimed = await claim_local(env, doc, ResumeRequest())
        assert claimed.lease is not None
        doc = await execute_claimed(env, claimed)
    return doc


async def execute_claimed(env: LocalEnv, run: RunDocument) -> RunDocument:
    """Run a claimed execution to its end with the SPEC §5.4 order: status, teardown, release.
    `begin()` (stop the other executions' sandboxes, then `run_claimed`) runs under the lease."""
    assert run.lease is not None
    token = run.lease.token
    cancel = CancelSignal()
    if env.interrupt is not None:
        env.interrupt.watch(cancel)
    events = EventLog(env.store, run.run_id, run.attempt, token, cancel, listener=env.on_event)
    execution = Execution.claimed(env, run, cancel, events)
    keeper = LeaseKeeper(
        env.store, run.run_id, token, run.lease.expires_at, env.settings.lease_timing(), cancel
    )
    if not keeper.held_at_start():
        raise LeaseLost(
            f"run {run.run_id}: the claim reached the store after its lease's loss margin (the"
            " store was busy); nothing ran. Resume it again once its lease is free."
        )
    events.deadline = keeper.seconds_left
    keeper_task = asyncio.ensure_future(keeper.run())
    try:
        await execution.begin("local", owner_name())
        outcome = await execution.run()
        await settle(execution.writer, events, outcome)
        await execution.teardown()
        await execution.writer.release()
    finally:
        keeper.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper_task
    return await env.store.get_run(run.run_id)
