"""Operations on the fleet's upkeep (SPEC §3, §5.9, §10): streams ensure, one sweeper pass,
garbage collection.

Garbage collection comes in two steps, so whoever calls it can show what will go and ask first:
`plan_gc` lists the settled runs not updated for the given age, `collect_garbage` deletes them
(their events and blobs with them), the staged uploads and the DLQ records older than that.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from engine.scratch import sweep_orphan_banks
from publisher.config import WireSettings
from publisher.connection import connect
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
            return GcPlan(age, cutoff, tuple(victims))
        after = page.next_after


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
    skew = env.engine.lease_timing().skew
    await sweep_orphan_banks(env.store, env.blobs, skew)  # SPEC §7.3: keys no record names
    uploads = await StagingStore(env.store, env.blobs).reap(plan.age, utcnow())
    removed = 0
    dlq_error: RunfleetError | None = None
    try:
        async with env.dlq() as dlq:
            for record in await dlq.list(older_than=plan.cutoff):
                removed += int(await dlq.delete(record.id))
    except RunfleetError as exc:
        dlq_error = exc
    return GcReport(deleted, uploads, removed, dlq_error)


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
