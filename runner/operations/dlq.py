"""Operations on dead-letter records (SPEC §3 records, §4 Replay, §10): list, show, replay,
purge.

A bulk replay goes record by record, each through the publisher's replay (a fresh attempt; the
record removed only once the replay's publication is recorded), so a crash half-way loses
nothing and a re-run finishes the job: records already replayed are recognised and removed,
never replayed twice. When NATS or the store is not there, the replay stops at the first such
failure: every other record would fail alike, each after its whole retry budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from engine.failures import FailureCode
from publisher.dlq import UNREADABLE, DlqRecord, DlqStore
from publisher.errors import MalformedMessage, RecordNotFound, UnsupportedSchema
from publisher.wire import RunMessage, decode
from runner.operations.env import Env
from runner.operations.errors import is_unreachable
from runner.operations.models import RecordDetail, ReplayOutcome, ReplayReport
from store import BlobNotFound, RunDocument, RunfleetError, RunNotFound, RunStatus, utcnow
from store.events import events_newest_first

DLQ_REASONS: tuple[str, ...] = (
    "attempt_ahead",
    "internal_error",
    "malformed",
    "max_deliveries",
    "no_claim_path",
    "retries_exhausted",
    "run_not_found",
    "tenant_mismatch",
    "unsupported_schema",
    UNREADABLE,
)
"""Every `reason` the fleet writes on a record (SPEC §5.2, §5.6: the runner's admission and
disposition, the backstop), and the one a record that does not read is shown with. A filter
naming anything else can only match nothing, so the operator surfaces refuse it as a mistyped
flag rather than answer an empty list. `tests/operations/test_dlq_reasons.py` keeps this in
step with the code that writes them."""


async def record_owner(env: Env, record: DlqRecord, fleet_tenant: str) -> str:
    """The tenant a record belongs to: its run's; a record no run can be found for (a
    message that did not decode, a run collected since) belongs to the fleet's tenant."""
    if record.run_id:
        try:
            return (await env.store.get_run(record.run_id)).tenant
        except RunNotFound:
            pass
    return fleet_tenant


async def records_of(
    env: Env, records: Sequence[DlqRecord], tenant: str, fleet_tenant: str
) -> list[DlqRecord]:
    """The records of `tenant` among `records` (the API and the console act for the caller's,
    the CLI for `RUNFLEET_TENANT`'s)."""
    return [r for r in records if await record_owner(env, r, fleet_tenant) == tenant]


def _dlq(store: DlqStore | None) -> DlqStore:
    assert store is not None, "Env.publisher() always has a DLQ store"
    return store


async def _select(
    dlq: DlqStore, ids: Sequence[int] | None, reason: str | None, older_than: timedelta | None
) -> list[DlqRecord]:
    if ids is not None:
        return [await dlq.get(i) for i in ids]
    cutoff = utcnow() - older_than if older_than is not None else None
    return await dlq.list(reason=reason, older_than=cutoff)


async def list_records(
    env: Env, *, reason: str | None = None, older_than: timedelta | None = None
) -> list[DlqRecord]:
    """Every record (with `reason`, or older than `older_than`, those only), by id."""
    async with env.dlq() as dlq:
        return await _select(dlq, None, reason, older_than)


async def select_records(
    env: Env,
    ids: Sequence[int] | None,
    *,
    reason: str | None = None,
    older_than: timedelta | None = None,
) -> list[DlqRecord]:
    """The records `ids` names (each must exist: `record_not_found`), or with `ids` None every
    record matching the filters — what a purge asks a person to confirm."""
    async with env.dlq() as dlq:
        return await _select(dlq, ids, reason, older_than)


async def show_record(env: Env, record_id: int) -> RecordDetail:
    async with env.dlq() as dlq:
        record = await dlq.get(record_id)
        message: RunMessage | None = None
        undecodable: str | None = None
        try:
            body = await dlq.body(record)
        except BlobNotFound as exc:
            # The record still says what died and why, and can be replayed or purged: a lost
            # body blob must not hide it (an on-call walkthrough: exit 1, API 500).
            body, undecodable = b"", f"the body is missing from the blob store: {exc.message}"
        else:
            try:
                message = decode(body, record.headers)
            except (MalformedMessage, UnsupportedSchema) as exc:
                undecodable = exc.message
        run: RunDocument | None = None
        if record.run_id:
            try:
                run = await env.store.get_run(record.run_id)
            except RunNotFound:
                run = None
    return RecordDetail(record, body, message, undecodable, run)


async def replay_records(
    env: Env,
    ids: Sequence[int] | None,
    *,
    reason: str | None = None,
    tenant: str | None = None,
) -> ReplayReport:
    """Replay the records `ids` names (or, with None, every record with `reason`). A refusal
    is that record's outcome and the others go on; unreachable infrastructure stops the
    replay and names the records not attempted."""
    from publisher.nats_errors import nats_boundary  # nats-py only once connected (ADR-0024)

    outcomes: list[ReplayOutcome] = []
    async with env.publisher() as pub:
        records = await _select(_dlq(pub.dlq), ids, reason, None)
        for index, record in enumerate(records):
            try:
                with nats_boundary(f"replaying DLQ record {record.id}"):
                    run = await pub.replay(record.id, tenant=tenant or env.tenant)
            except RunfleetError as exc:
                outcomes.append(ReplayOutcome(record.id, error=exc))
                if is_unreachable(exc):
                    rest = tuple(r.id for r in records[index + 1 :])
                    return ReplayReport(tuple(outcomes), rest, stopped_by=exc)
                continue
            outcomes.append(ReplayOutcome(record.id, run=run))
    return ReplayReport(tuple(outcomes))


async def purge_records(env: Env, ids: Sequence[int]) -> list[int]:
    """Remove records for good; returns the ids that were there to remove."""
    async with env.dlq() as dlq:
        return [record_id for record_id in ids if await dlq.delete(record_id)]


async def parked_record_id(env: Env, run: RunDocument) -> int | None:
    """The DLQ record a run parked `DLQ_PARKED` waits on: its `run_dlq_parked` event at the
    run's attempt names it (SPEC §6.3); None when there is none, or it was purged since. What
    `status` shows, so the way back (`dlq replay ID`) is on the screen that says the run is
    parked."""
    if run.status is not RunStatus.FAILED_RESUMABLE or run.failure_code != FailureCode.DLQ_PARKED:
        return None
    found: int | None = None
    # From the newest back: the park is among the run's last few events, whatever its history.
    async for event in events_newest_first(env.store, run.run_id):
        record_id = event.data.get("record_id")
        parked = event.type == "run_dlq_parked" and event.attempt == run.attempt
        if parked and isinstance(record_id, int):
            found = record_id
            break
    if found is None:
        return None
    try:
        async with env.dlq() as dlq:
            await dlq.get(found)
    except RecordNotFound:
        return None  # purged (or replayed) since: the way back is `resume`
    except RunfleetError as exc:
        if not is_unreachable(exc):
            raise
        # NATS is not there: `status` still shows the run, with the id its event names.
    return found
