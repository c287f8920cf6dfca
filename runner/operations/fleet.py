"""Operations on the fleet's upkeep (SPEC §3, §5.9, §10): streams ensure, one sweeper pass,
garbage collection.

Garbage collection comes in two steps, so whoever calls it can show what will go and ask first:
`plan_gc` lists the settled runs not updated for the given age and the DLQ records older than
that whose run is gone or settled; `collect_garbage` deletes them (the runs' events and blobs
with them) and the staged uploads as old. A record whose run still waits on it (parked
`failed_resumable DLQ_PARKED`, its `run_dlq_parked` event naming it) is kept whatever its age:
it is the run's way back (`dlq replay`), and deleting it left a parked run whose documented
remedy named a record that no longer existed (found by an operator walkthrough).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Collection
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from engine.scratch import remove_tree, sweep_orphan_banks
from publisher.config import WireSettings
from publisher.connection import connect
from publisher.errors import RecordNotFound
from publisher.nats_errors import nats_boundary
from publisher.streams import EnsureReport, ensure_streams
from publisher.wire import WireNames
from runner.operations.env import Env
from runner.operations.models import GcPlan, GcReport, SweepResult
from store import DocumentInvalid, RunfleetError, RunNotFound, RunQuery, RunStatus, utcnow
from store.staging import StagingStore

if TYPE_CHECKING:
    from runner.runner import Runner

SETTLED = (RunStatus.FINISHED, RunStatus.FAILED, RunStatus.CANCELLED)
"""What garbage collection may delete: runs that will not move again by themselves."""
_PAGE = 500


async def ensure_wire(wire: WireSettings | None = None) -> EnsureReport:
    """Create or update the streams and consumers of the wire contract (idempotent). Needs
    NATS only: the deploy Job runs it before any store exists."""
    wire = wire or WireSettings()
    nc, js = await connect(wire, name="runfleet-streams")
    try:
        with nats_boundary("ensuring the streams"):
            return await ensure_streams(js, WireNames(wire.namespace), wire)
    finally:
        await nc.close()


def _sweep_runner(env: Env) -> Runner:
    """A runner that does not consume: only its services, for a one-off sweep pass."""
    from runner.config import RunnerSettings
    from runner.runner import Runner

    return Runner(
        store=env.store,
        driver=env.driver(),
        data_dir=env.data_dir,
        blobs=env.blobs,
        settings=RunnerSettings(sweeper=False, backstop=False, slots=1, http_host="127.0.0.1"),
        engine=env.engine,
        wire=env.wire(),
        consume=False,
    )


async def sweep(env: Env) -> SweepResult:
    """One orphan-sweeper pass now, without the election lock (its actions are CASes)."""
    from runner.sweeper import Sweeper  # the runner's machinery loads only for a sweep

    runner = _sweep_runner(env)
    with nats_boundary("sweeping"):
        async with runner:
            assert runner.svc is not None
            report = await Sweeper(runner.svc).sweep_once(force=True)
    return SweepResult(dict(report.actions))


async def plan_gc(env: Env, age: timedelta) -> GcPlan:
    """The settled runs (every tenant's) not updated for `age`."""
    cutoff = utcnow() - age
    victims: list[str] = []
    after: str | None = None
    while True:
        page = await env.store.list_runs(
            RunQuery(statuses=SETTLED, updated_before=cutoff, after_run_id=after, limit=_PAGE)
        )
        victims.extend(r.run_id for r in page.runs)
        if page.next_after is None:
            break
        after = page.next_after
    dlq_ids: list[int] = []
    kept = 0
    planned = set(victims)
    try:
        async with env.dlq() as dlq:
            for record in await dlq.list(older_than=cutoff):
                if await _record_garbage(env, record.run_id, planned=planned):
                    dlq_ids.append(record.id)
                else:
                    kept += 1
    except RunfleetError as exc:
        return GcPlan(age, cutoff, tuple(victims), dlq_error=exc)
    return GcPlan(age, cutoff, tuple(victims), tuple(dlq_ids), kept)


async def collect_garbage(env: Env, plan: GcPlan) -> GcReport:
    """Delete what `plan` lists, then the staged uploads and DLQ records older than its age.
    NATS being unreachable leaves the DLQ records (`dlq_error` says why), not the rest."""
    deleted = 0
    for run_id in plan.run_ids:
        if not await _still_garbage(env, run_id, plan.cutoff):
            continue
        for blob in await env.blobs.list(f"runs/{run_id}/"):
            await env.blobs.delete(blob.key)
        deleted += int(await env.store.delete_run(run_id))
        await asyncio.to_thread(_remove_host_dirs, env.data_dir, run_id)
    skew = env.engine.lease_timing().skew
    await sweep_orphan_banks(env.store, env.blobs, skew)  # SPEC §7.3: keys no record names
    uploads = await StagingStore(env.store, env.blobs).reap(plan.age, utcnow())
    removed, kept = 0, plan.dlq_kept
    dlq_error = plan.dlq_error
    if plan.dlq_ids:
        try:
            async with env.dlq() as dlq:
                for record_id in plan.dlq_ids:
                    try:
                        record = await dlq.get(record_id)
                    except RecordNotFound:
                        continue  # replayed or purged since the plan
                    if await _record_garbage(env, record.run_id):
                        removed += int(await dlq.delete(record_id))
                    else:
                        kept += 1  # its run was resumed and parked again since the plan
        except RunfleetError as exc:
            dlq_error = exc
    return GcReport(deleted, uploads, removed, dlq_error, kept)


HOST_DIRS = ("work", "scratch", "sandboxes", "attachments")
"""What executions on this host keep per run under `RUNFLEET_DATA` (`engine.execution`, the
local driver's records): left behind by every run, and by a SIGKILLed runner's workspace
(found by an operator walkthrough: they piled up for runs `gc` had deleted)."""
_SAFE_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _remove_host_dirs(data_dir: Path, run_id: str) -> None:
    """A deleted run's directories on this host. No execution of it can be live: `gc` deletes
    only settled runs not updated for its age. An id that is not one path segment is left."""
    if not _SAFE_SEGMENT.fullmatch(run_id) or ".." in run_id:
        return
    for name in HOST_DIRS:
        with contextlib.suppress(OSError):
            remove_tree(data_dir / name / run_id)  # read-only directories too


async def _record_garbage(env: Env, run_id: str | None, *, planned: Collection[str] = ()) -> bool:
    """Whether an old DLQ record may go: it names no run (a malformed message), its run is
    gone, or its run is settled (or about to be deleted with this plan)."""
    if run_id is None or run_id in planned:
        return True
    try:
        run = await env.store.get_run(run_id)
    except RunNotFound:
        return True
    except DocumentInvalid:
        return False  # unreadable: not judged garbage on a guess
    return run.status in SETTLED


async def _still_garbage(env: Env, run_id: str, cutoff: datetime) -> bool:
    """Whether a planned run is still settled and untouched since the plan's cutoff. The CLI
    asks for confirmation between the plan and the deletion, and a cancelled run resumed
    meanwhile was deleted while queued, its copy then dead-lettered `run_not_found` (found by
    review). A change in the instant between this read and the delete is not caught."""
    try:
        run = await env.store.get_run(run_id)
    except RunNotFound:
        return False
    except DocumentInvalid:
        return True  # listed as settled by its query columns; unreadable, and still garbage
    return run.status in SETTLED and run.updated_at < cutoff
