"""The `RunStore` contract (SPEC §2 write conditions, §6.3 events, §8 staging, §9 store).

Every test here runs on every backend (`run_store` is parametrised in `conftest.py`); each is
named after the rule it checks. The SQLite-only tests at the end cover what only a file can do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import secrets
import sqlite3
import uuid
from contextlib import closing
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from store.cas import CasConflict, Eq, In, LeaseFree, Ne, Update
from store.codec import encode
from store.errors import (
    DocumentInvalid,
    IllegalTransition,
    RunAlreadyExists,
    RunNotFound,
    StoreCorrupt,
    StoreError,
)
from store.events import events_newest_first
from store.models import (
    Checkpoint,
    Interaction,
    InteractionStatus,
    Lease,
    Origin,
    Publication,
    RunDocument,
    RunStatus,
    StagedFile,
    StagedUpload,
)
from store.protocols import EventDraft, RunQuery, RunStore
from store.sqlite import SqliteRunStore
from store.timeutil import to_ms, utcnow

if TYPE_CHECKING:
    from tests.store.conftest import Backend, MakeRun

SKEW = timedelta(seconds=2)


def lease(token: str, expires_at: datetime, *, attempt: int = 1, owner: str = "runner-a") -> Lease:
    return Lease(owner=owner, token=token, attempt=attempt, stream_seq=7, expires_at=expires_at)


def lease_set(value: Lease) -> dict[str, Any]:
    """A lease as an `Update.set` value (a plain mapping; the store stores it in storage form)."""
    return value.model_dump()


def claim(now: datetime, token: str) -> tuple[list[Any], Update]:
    """A fresh claim of a queued run at attempt 1 (SPEC §5.3), as one CAS."""
    conditions = [Eq("status", "queued"), Eq("attempt", 1), LeaseFree(now, SKEW)]
    update = Update(
        set={
            "status": RunStatus.RUNNING,
            "lease": lease_set(lease(token, now + timedelta(seconds=30), owner=f"owner-{token}")),
        }
    )
    return conditions, update


# -- create / get ------------------------------------------------------------------------------


async def test_create_then_get_round_trips_the_document(run_store: RunStore, make_run: MakeRun):
    doc = make_run(inputs={"name": "world", "n": [1, 2, {"deep": True}]}, tenant="acme")
    assert await run_store.create_run(doc) == doc
    assert await run_store.get_run(doc.run_id) == doc


async def test_create_only_refuses_an_existing_id(run_store: RunStore, make_run: MakeRun):
    original = await run_store.create_run(make_run(inputs={"v": 1}))
    impostor = make_run(run_id=original.run_id, tenant="other", inputs={"v": 2})
    with pytest.raises(RunAlreadyExists):
        await run_store.create_run(impostor)
    assert await run_store.get_run(original.run_id) == original


async def test_events_ride_with_the_create_in_order_and_never_on_refusal(
    run_store: RunStore, make_run: MakeRun
):
    run = make_run()
    drafts = [
        EventDraft("run_launched", {"workflow": "hello"}, attempt=1),
        EventDraft("run_queued", {"attempt": 1, "kind": "launch"}, attempt=1),
    ]
    await run_store.create_run(run, events=drafts)
    got = await run_store.read_events(run.run_id)
    assert [(e.seq, e.type, e.data, e.attempt) for e in got] == [
        (1, "run_launched", {"workflow": "hello"}, 1),
        (2, "run_queued", {"attempt": 1, "kind": "launch"}, 1),
    ]
    with pytest.raises(RunAlreadyExists):
        await run_store.create_run(run, events=[EventDraft("run_launched", {}, attempt=1)])
    assert [e.seq for e in await run_store.read_events(run.run_id)] == [1, 2]
    appended = await run_store.append_event(run.run_id, "run_claimed", {}, attempt=1)
    assert appended.seq == 3


async def test_events_ride_with_the_state_write_they_describe_gap_free_and_only_when_it_lands(
    run_store: RunStore, make_run: MakeRun
):
    """Issue 19 lever 1 (SPEC §6.3): `update_run(..., events=...)` appends the write's events
    with it, after any appended before, and a refused write appends none."""
    now = datetime.now(UTC)
    run = make_run(status=RunStatus.QUEUED)
    await run_store.create_run(run, events=[EventDraft("run_launched", {}, attempt=1)])
    conds, update = claim(now, "tok-1")
    claimed = await run_store.update_run(
        run.run_id,
        conds,
        update,
        events=[EventDraft("run_claimed", {"path": "fresh"}, attempt=1, execution="tok-1")],
    )
    assert isinstance(claimed, RunDocument) and claimed.status is RunStatus.RUNNING
    lost = await run_store.update_run(
        run.run_id, conds, update, events=[EventDraft("run_claimed", {}, attempt=1)]
    )
    assert isinstance(lost, CasConflict)
    await run_store.append_event(run.run_id, "node_started", {"node": "a"}, attempt=1)
    done = await run_store.update_run(
        run.run_id,
        [Eq("lease.token", "tok-1"), Eq("status", RunStatus.RUNNING)],
        Update(set={"status": RunStatus.FINISHED}, unset=["lease"]),
        events=[
            EventDraft("node_finished", {"node": "a"}, attempt=1, execution="tok-1"),
            EventDraft("run_finished", {}, attempt=1, execution="tok-1"),
        ],
    )
    assert isinstance(done, RunDocument) and done.lease is None
    got = await run_store.read_events(run.run_id)
    assert [(e.seq, e.type) for e in got] == [
        (1, "run_launched"),
        (2, "run_claimed"),
        (3, "node_started"),
        (4, "node_finished"),
        (5, "run_finished"),
    ]
    assert (got[1].execution, got[1].data) == ("tok-1", {"path": "fresh"})


def test_a_drafts_storage_form_is_what_encoding_its_event_gives():
    at = datetime(2026, 12, 1, 12, 0, 0, 123_000, tzinfo=UTC)
    draft = EventDraft("node_finished", {"node": "a", "when": at}, attempt=2, execution="t")
    assert draft.stored("r1", 7, to_ms(at)) == encode(draft.event("r1", 7, at))


async def test_create_and_get_round_trip_datetimes_as_aware_utc_at_ms_precision(
    run_store: RunStore, make_run: MakeRun
):
    plus_two = timezone(timedelta(hours=2))
    created = datetime(2026, 3, 4, 5, 6, 7, 891_234, tzinfo=plus_two)
    expires = datetime(2026, 3, 4, 3, 7, 0, 999_999, tzinfo=UTC)
    doc = make_run(
        status=RunStatus.RUNNING,
        created_at=created,
        updated_at=created,
        attempt_at=created,
        lease=lease("tok", expires),
    )
    await run_store.create_run(doc)
    got = await run_store.get_run(doc.run_id)
    for value in (got.created_at, got.updated_at, got.attempt_at):
        assert value.utcoffset() == timedelta(0)
        assert value == datetime(2026, 3, 4, 3, 6, 7, 891_000, tzinfo=UTC)
    assert got.lease is not None
    assert got.lease.expires_at.utcoffset() == timedelta(0)
    assert got.lease.expires_at == datetime(2026, 3, 4, 3, 7, 0, 999_000, tzinfo=UTC)

    # A datetime written by a compare-and-set comes back the same way.
    later = datetime(2026, 3, 4, 3, 8, 1, 234_567, tzinfo=plus_two)
    updated = await run_store.update_run(
        doc.run_id, [Eq("lease.token", "tok")], Update(set={"lease.expires_at": later})
    )
    assert isinstance(updated, RunDocument)
    reread = await run_store.get_run(doc.run_id)
    assert reread.lease is not None
    assert reread.lease.expires_at == datetime(2026, 3, 4, 1, 8, 1, 234_000, tzinfo=UTC)
    assert reread.lease.expires_at.utcoffset() == timedelta(0)
    assert reread.updated_at.utcoffset() == timedelta(0)


async def test_get_of_an_unknown_id_raises_run_not_found(run_store: RunStore):
    with pytest.raises(RunNotFound):
        await run_store.get_run(f"missing-{uuid.uuid4()}")


async def test_update_of_an_unknown_id_raises_run_not_found(run_store: RunStore):
    with pytest.raises(RunNotFound):
        await run_store.update_run(f"missing-{uuid.uuid4()}", [], Update(set={"error": "x"}))


# -- compare-and-set -----------------------------------------------------------------------------


async def test_fifty_concurrent_claims_on_one_run_have_exactly_one_winner(
    run_store: RunStore, make_run: MakeRun
):
    doc = await run_store.create_run(make_run())
    now = utcnow()

    async def one_claim(i: int) -> RunDocument | CasConflict:
        conditions, update = claim(now, f"token-{i}")
        return await run_store.update_run(doc.run_id, conditions, update)

    results = await asyncio.gather(*(one_claim(i) for i in range(50)))

    winners = [r for r in results if isinstance(r, RunDocument)]
    losers = [r for r in results if isinstance(r, CasConflict)]
    assert len(winners) == 1
    assert len(losers) == 49
    winner = winners[0]
    assert winner.status == RunStatus.RUNNING
    assert winner.lease is not None
    stored = await run_store.get_run(doc.run_id)
    assert stored.lease == winner.lease
    assert stored.status == RunStatus.RUNNING
    assert stored.version == doc.version + 1
    for lost in losers:
        assert lost.current is not None
        assert lost.current.lease is not None
        assert lost.current.lease.token == winner.lease.token


async def test_claims_from_separate_store_instances_have_exactly_one_winner(
    run_store: RunStore, make_run: MakeRun, store_backend: Backend
):
    """Several processes share one store (SPEC §9): the CAS is atomic across instances too."""
    stores = [run_store, *[await store_backend.open_another() for _ in range(4)]]
    doc = await run_store.create_run(make_run())
    now = utcnow()

    async def one_claim(i: int) -> RunDocument | CasConflict:
        conditions, update = claim(now, f"token-{i}")
        return await stores[i % len(stores)].update_run(doc.run_id, conditions, update)

    results = await asyncio.gather(*(one_claim(i) for i in range(50)))
    winners = [r for r in results if isinstance(r, RunDocument)]
    assert len(winners) == 1
    assert sum(isinstance(r, CasConflict) for r in results) == 49
    for store in stores:
        assert (await store.get_run(doc.run_id)).lease == winners[0].lease


async def test_cas_conflict_returns_the_current_document(run_store: RunStore, make_run: MakeRun):
    doc = await run_store.create_run(make_run())
    moved = await run_store.update_run(
        doc.run_id, [Eq("version", 1)], Update(set={"error": "first"})
    )
    assert isinstance(moved, RunDocument)

    stale = await run_store.update_run(
        doc.run_id, [Eq("version", 1)], Update(set={"error": "second"})
    )
    assert isinstance(stale, CasConflict)
    assert stale.current == moved
    assert stale.current == await run_store.get_run(doc.run_id)
    assert stale.current is not None and stale.current.error == "first"


async def test_version_bumps_on_a_normal_write_but_not_with_bump_version_false(
    run_store: RunStore, make_run: MakeRun
):
    now = utcnow()
    doc = await run_store.create_run(make_run(status=RunStatus.RUNNING, lease=lease("tok", now)))
    assert doc.version == 1

    first = await run_store.update_run(doc.run_id, [], Update(set={"error": "e1"}))
    assert isinstance(first, RunDocument)
    assert first.version == 2
    assert first.updated_at >= doc.updated_at

    refreshed_until = now + timedelta(seconds=60)
    refresh = await run_store.update_run(
        doc.run_id,
        [Eq("lease.token", "tok")],
        Update(set={"lease.expires_at": refreshed_until}, bump_version=False),
    )
    assert isinstance(refresh, RunDocument)
    assert refresh.version == 2
    assert refresh.updated_at == first.updated_at
    assert refresh.lease is not None and refresh.lease.expires_at == refreshed_until

    publication = {"attempt": 1, "stream_seq": 42, "at": now, "msg_id": f"{doc.run_id}:1"}
    published = await run_store.update_run(
        doc.run_id, [], Update(set={"publication": publication}, bump_version=False)
    )
    assert isinstance(published, RunDocument)
    assert published.version == 2
    assert published.publication is not None and published.publication.stream_seq == 42

    second = await run_store.update_run(doc.run_id, [Eq("version", 2)], Update(set={"error": None}))
    assert isinstance(second, RunDocument)
    assert second.version == 3
    assert await run_store.get_run(doc.run_id) == second


async def test_lease_expired_by_more_than_skew_is_free(run_store: RunStore, make_run: MakeRun):
    now = utcnow()
    doc = await run_store.create_run(
        make_run(status=RunStatus.RUNNING, lease=lease("old", now - SKEW - timedelta(seconds=1)))
    )
    result = await run_store.update_run(
        doc.run_id, [LeaseFree(now, SKEW)], Update(set={"cancel_requested": True})
    )
    assert isinstance(result, RunDocument)
    assert result.cancel_requested is True


async def test_lease_expired_exactly_skew_ago_is_free(run_store: RunStore, make_run: MakeRun):
    now = utcnow()
    doc = await run_store.create_run(
        make_run(status=RunStatus.RUNNING, lease=lease("old", now - SKEW))
    )
    result = await run_store.update_run(
        doc.run_id, [LeaseFree(now, SKEW)], Update(set={"cancel_requested": True})
    )
    assert isinstance(result, RunDocument)


async def test_lease_expired_by_less_than_skew_is_not_free(run_store: RunStore, make_run: MakeRun):
    now = utcnow()
    doc = await run_store.create_run(
        make_run(
            status=RunStatus.RUNNING, lease=lease("old", now - SKEW + timedelta(milliseconds=1))
        )
    )
    result = await run_store.update_run(
        doc.run_id, [LeaseFree(now, SKEW)], Update(set={"cancel_requested": True})
    )
    assert isinstance(result, CasConflict)
    assert result.current == doc
    assert await run_store.get_run(doc.run_id) == doc


async def test_unexpired_lease_is_not_free(run_store: RunStore, make_run: MakeRun):
    now = utcnow()
    doc = await run_store.create_run(
        make_run(status=RunStatus.RUNNING, lease=lease("live", now + timedelta(seconds=30)))
    )
    result = await run_store.update_run(
        doc.run_id, [LeaseFree(now, SKEW)], Update(set={"cancel_requested": True})
    )
    assert isinstance(result, CasConflict)


async def test_absent_lease_is_free(run_store: RunStore, make_run: MakeRun):
    doc = await run_store.create_run(make_run())
    assert doc.lease is None
    result = await run_store.update_run(
        doc.run_id, [LeaseFree(utcnow(), SKEW)], Update(set={"cancel_requested": True})
    )
    assert isinstance(result, RunDocument)


async def test_unset_lease_makes_it_free_again(run_store: RunStore, make_run: MakeRun):
    now = utcnow()
    doc = await run_store.create_run(
        make_run(status=RunStatus.RUNNING, lease=lease("live", now + timedelta(seconds=30)))
    )
    released = await run_store.update_run(
        doc.run_id, [Eq("lease.token", "live")], Update(unset=["lease"])
    )
    assert isinstance(released, RunDocument)
    assert released.lease is None
    again = await run_store.update_run(
        doc.run_id, [LeaseFree(now, SKEW)], Update(set={"cancel_requested": True})
    )
    assert isinstance(again, RunDocument)


async def test_eq_none_matches_an_absent_field(run_store: RunStore, make_run: MakeRun):
    doc = await run_store.create_run(make_run())
    result = await run_store.update_run(
        doc.run_id, [Eq("lease.token", None)], Update(set={"error": "ok"})
    )
    assert isinstance(result, RunDocument)
    refused = await run_store.update_run(
        doc.run_id, [Eq("lease.token", "someone")], Update(set={"error": "no"})
    )
    assert isinstance(refused, CasConflict)


async def test_ne_condition_matches_an_absent_field(run_store: RunStore, make_run: MakeRun):
    doc = await run_store.create_run(make_run())
    assert doc.lease is None and doc.scratch is None
    result = await run_store.update_run(
        doc.run_id,
        [Ne("lease.token", "someone"), Ne("scratch.key", "k")],
        Update(set={"error": "ok"}),
    )
    assert isinstance(result, RunDocument)
    assert result.error == "ok"


async def test_ne_condition_refuses_an_equal_value(run_store: RunStore, make_run: MakeRun):
    doc = await run_store.create_run(make_run(failure_code="SANDBOX_LOST"))
    refused = await run_store.update_run(
        doc.run_id, [Ne("failure_code", "SANDBOX_LOST")], Update(set={"error": "no"})
    )
    assert isinstance(refused, CasConflict)
    allowed = await run_store.update_run(
        doc.run_id, [Ne("failure_code", "BUDGET_EXCEEDED")], Update(set={"error": "yes"})
    )
    assert isinstance(allowed, RunDocument)
    assert allowed.error == "yes"


async def test_in_condition_matches_any_listed_value(run_store: RunStore, make_run: MakeRun):
    doc = await run_store.create_run(make_run(status=RunStatus.PAUSED_OPERATOR))
    refused = await run_store.update_run(
        doc.run_id,
        [In("status", (RunStatus.FAILED_RESUMABLE, RunStatus.CANCELLED))],
        Update(set={"status": RunStatus.QUEUED}),
    )
    assert isinstance(refused, CasConflict)
    assert (await run_store.get_run(doc.run_id)).status == RunStatus.PAUSED_OPERATOR

    moved = await run_store.update_run(
        doc.run_id,
        [In("status", (RunStatus.CANCELLED, RunStatus.PAUSED_OPERATOR)), In("attempt", (1, 2))],
        Update(set={"status": RunStatus.QUEUED, "attempt": 2}),
    )
    assert isinstance(moved, RunDocument)
    assert (moved.status, moved.attempt) == (RunStatus.QUEUED, 2)


async def test_unset_removes_a_field(
    run_store: RunStore, make_run: MakeRun, store_backend: Backend
):
    now = utcnow()
    doc = await run_store.create_run(
        make_run(
            status=RunStatus.RUNNING,
            error="boom",
            failure_code="SANDBOX_LOST",
            lease=lease("tok", now + timedelta(seconds=30)),
        )
    )
    result = await run_store.update_run(
        doc.run_id, [], Update(unset=["error", "failure_code", "lease.stream_seq"])
    )
    assert isinstance(result, RunDocument)
    assert result.error is None and result.failure_code is None
    assert result.lease is not None
    assert result.lease.stream_seq is None
    assert result.lease.token == "tok"
    assert doc.lease is not None and result.lease.expires_at == doc.lease.expires_at
    raw = await store_backend.get_raw_run(doc.run_id)
    assert raw is not None
    assert "error" not in raw and "failure_code" not in raw
    assert "stream_seq" not in raw["lease"]
    assert await run_store.get_run(doc.run_id) == result


async def test_illegal_status_transition_is_refused(run_store: RunStore, make_run: MakeRun):
    done = await run_store.create_run(make_run(status=RunStatus.FINISHED))
    with pytest.raises(IllegalTransition):
        await run_store.update_run(
            done.run_id, [Eq("status", "finished")], Update(set={"status": RunStatus.RUNNING})
        )
    assert await run_store.get_run(done.run_id) == done

    # One illegal expected status among several is enough to refuse.
    with pytest.raises(IllegalTransition):
        await run_store.update_run(
            done.run_id,
            [In("status", (RunStatus.QUEUED, RunStatus.FINISHED))],
            Update(set={"status": RunStatus.RUNNING}),
        )
    assert await run_store.get_run(done.run_id) == done


async def test_status_write_without_a_status_condition_is_refused(
    run_store: RunStore, make_run: MakeRun
):
    queued = await run_store.create_run(make_run())
    for conditions in ([], [Eq("version", 1), Eq("attempt", 1)]):
        with pytest.raises(IllegalTransition):
            await run_store.update_run(
                queued.run_id, conditions, Update(set={"status": RunStatus.RUNNING})
            )
    with pytest.raises(IllegalTransition):
        await run_store.update_run(
            queued.run_id, [Eq("status", "queued")], Update(unset=["status"])
        )
    assert await run_store.get_run(queued.run_id) == queued


async def test_write_to_an_immutable_or_unknown_field_is_refused(
    run_store: RunStore, make_run: MakeRun
):
    doc = await run_store.create_run(make_run(tenant="acme"))
    for update in (
        Update(set={"tenant": "other"}),
        Update(set={"run_id": "other"}),
        Update(set={"version": 99}),
        Update(set={"no_such_field": 1}),
    ):
        with pytest.raises(IllegalTransition):
            await run_store.update_run(doc.run_id, [], update)
    assert await run_store.get_run(doc.run_id) == doc


async def test_update_that_would_store_an_invalid_document_is_refused_and_nothing_written(
    run_store: RunStore, make_run: MakeRun
):
    """A misspelt nested path passes the top-level field check; the stored document must still
    never become one that fails validation (models.py: extra="forbid")."""
    now = utcnow()
    doc = await run_store.create_run(
        make_run(status=RunStatus.RUNNING, lease=lease("tok", now + timedelta(seconds=30)))
    )
    with pytest.raises(DocumentInvalid, match=doc.run_id):
        await run_store.update_run(
            doc.run_id, [Eq("lease.token", "tok")], Update(set={"lease.expire_at": now})
        )
    assert await run_store.get_run(doc.run_id) == doc


# -- invalid documents ---------------------------------------------------------------------------


async def test_stored_document_failing_validation_raises_document_invalid_and_is_kept(
    run_store: RunStore, make_run: MakeRun, store_backend: Backend
):
    raw = encode(make_run())
    raw["attempt"] = 0  # attempt starts at 1 and never decreases
    await store_backend.put_raw_run(raw)
    run_id = raw["run_id"]

    with pytest.raises(DocumentInvalid, match=run_id):
        await run_store.get_run(run_id)
    # A refused compare-and-set re-reads the document: it is reported, not repaired.
    with pytest.raises(DocumentInvalid, match=run_id):
        await run_store.update_run(run_id, [Eq("version", 99)], Update(set={"error": "x"}))
    assert await store_backend.get_raw_run(run_id) == raw


async def test_a_listing_names_a_run_that_does_not_validate_and_lists_every_other(
    run_store: RunStore, make_run: MakeRun, store_backend: Backend
):
    """One bad row made `runfleet runs` (and the API's list, a 500) show no run at all."""
    before = await run_store.create_run(make_run())
    raw = encode(make_run())
    raw["attempt"] = "not-a-number"
    await store_backend.put_raw_run(raw)
    after = await run_store.create_run(make_run())

    page = await run_store.list_runs(RunQuery(tenant="default"))
    assert [r.run_id for r in page.runs] == [before.run_id, after.run_id]
    (bad,) = page.unreadable
    assert bad.run_id == raw["run_id"] and "attempt" in bad.error

    # The bad row counts for the page: paging goes on past it.
    first = await run_store.list_runs(RunQuery(tenant="default", limit=2))
    assert [r.run_id for r in first.runs] == [before.run_id]
    assert first.next_after == raw["run_id"]
    rest = await run_store.list_runs(
        RunQuery(tenant="default", limit=2, after_run_id=first.next_after)
    )
    assert [r.run_id for r in rest.runs] == [after.run_id] and rest.unreadable == []


async def test_a_document_a_newer_build_wrote_reads_without_the_fields_this_build_does_not_know(
    run_store: RunStore, make_run: MakeRun, store_backend: Backend
):
    """A rollback met every record a newer build had written with a field it added as invalid
    (staged uploads' `claimed_by`), and the older sweeper, `gc` and `launch --attach` failed on
    them for good (an upgrade walkthrough). Unknown fields, top-level or nested, are read
    without; a narrow write keeps them for the newer build; a known field of the wrong shape is
    still refused."""
    doc = make_run(lease=lease("t", utcnow() + timedelta(seconds=30)))
    raw = encode(doc)
    raw["added_by_a_newer_build"] = {"any": ["shape"]}
    raw["lease"]["also_new"] = 1
    await store_backend.put_raw_run(raw)

    read = await run_store.get_run(doc.run_id)
    assert read == doc
    assert [r.run_id for r in (await run_store.list_runs(RunQuery(tenant="default"))).runs] == [
        doc.run_id
    ]
    written = await run_store.update_run(
        doc.run_id, [Eq("version", doc.version)], Update(set={"error": "noted"})
    )
    assert isinstance(written, RunDocument) and written.error == "noted"
    stored = await store_backend.get_raw_run(doc.run_id)
    assert stored is not None and stored["added_by_a_newer_build"] == {"any": ["shape"]}

    broken = encode(make_run())
    broken["unknown"] = 1
    broken["attempt"] = "not-a-number"
    await store_backend.put_raw_run(broken)
    with pytest.raises(DocumentInvalid):
        await run_store.get_run(broken["run_id"])


# -- queries -----------------------------------------------------------------------------------


async def test_list_runs_filters_by_status_tenant_failure_code_lease_and_time(
    run_store: RunStore, make_run: MakeRun
):
    base = utcnow()
    hour = timedelta(hours=1)

    def at(offset: timedelta) -> dict[str, datetime]:
        return {"created_at": base + offset, "updated_at": base + offset}

    runs = {
        "a_queued": make_run(tenant="a", **at(-2 * hour)),
        "a_running_expired": make_run(
            tenant="a",
            status=RunStatus.RUNNING,
            lease=lease("t1", base - timedelta(minutes=1)),
            **at(-hour),
        ),
        "b_failed_sandbox": make_run(
            tenant="b",
            status=RunStatus.FAILED_RESUMABLE,
            failure_code="SANDBOX_LOST",
            **at(timedelta(0)),
        ),
        "b_running_live": make_run(
            tenant="b",
            status=RunStatus.RUNNING,
            lease=lease("t2", base + timedelta(minutes=10)),
            origin=Origin.LOCAL,
            **at(hour),
        ),
        "a_failed_budget": make_run(
            tenant="a",
            status=RunStatus.FAILED_RESUMABLE,
            failure_code="BUDGET_EXCEEDED",
            **at(-3 * hour),
        ),
        "a_failed_terminal": make_run(
            tenant="a", status=RunStatus.FAILED, failure_code="WORKFLOW_INVALID", **at(2 * hour)
        ),
    }
    for doc in runs.values():
        await run_store.create_run(doc)
    name_of = {doc.run_id: name for name, doc in runs.items()}

    async def names(**filters: Any) -> list[str]:
        page = await run_store.list_runs(RunQuery(**filters))
        ids = [r.run_id for r in page.runs]
        assert ids == sorted(ids), "pages are ordered by run_id"
        assert page.next_after is None
        return sorted(name_of[i] for i in ids)

    assert await names() == sorted(runs)
    assert await names(statuses=[RunStatus.RUNNING]) == ["a_running_expired", "b_running_live"]
    assert await names(statuses=[RunStatus.FAILED_RESUMABLE, RunStatus.FAILED]) == [
        "a_failed_budget",
        "a_failed_terminal",
        "b_failed_sandbox",
    ]
    assert await names(tenant="b") == ["b_failed_sandbox", "b_running_live"]
    assert await names(tenant="nobody") == []
    assert await names(origin=Origin.LOCAL) == ["b_running_live"]
    assert await names(failure_codes=["SANDBOX_LOST", "WORKFLOW_INVALID"]) == [
        "a_failed_terminal",
        "b_failed_sandbox",
    ]
    assert await names(lease_expires_before=base) == ["a_running_expired"]
    assert await names(created_since=base) == [
        "a_failed_terminal",
        "b_failed_sandbox",
        "b_running_live",
    ]
    assert await names(updated_before=base - hour) == ["a_failed_budget", "a_queued"]
    assert await names(statuses=[RunStatus.RUNNING], tenant="a") == ["a_running_expired"]
    assert (
        await names(
            statuses=[RunStatus.FAILED_RESUMABLE], tenant="a", failure_codes=["SANDBOX_LOST"]
        )
        == []
    )


async def test_list_runs_keyset_paging_returns_every_run_once(
    run_store: RunStore, make_run: MakeRun
):
    ids = [(await run_store.create_run(make_run())).run_id for _ in range(25)]

    seen: list[str] = []
    sizes: list[int] = []
    after: str | None = None
    for _ in range(10):  # bounded: a paging bug must fail, not hang
        page = await run_store.list_runs(RunQuery(after_run_id=after, limit=10))
        sizes.append(len(page.runs))
        seen.extend(r.run_id for r in page.runs)
        if page.next_after is None:
            break
        assert page.next_after == page.runs[-1].run_id
        after = page.next_after

    assert sizes == [10, 10, 5]
    assert seen == sorted(ids)
    assert len(set(seen)) == 25


async def test_list_run_copies_pages_what_list_runs_pages_with_each_runs_recorded_copy(
    run_store: RunStore, make_run: MakeRun
):
    """The sweeper's first look (issue 19): the same runs, filters and keyset paging as
    `list_runs`, each as its attempt and its publication's attempt and sequence only."""
    at = utcnow()
    docs = [
        make_run(),  # never published
        make_run(publication=Publication(attempt=1, stream_seq=7, at=at)),
        make_run(attempt=2, publication=Publication(attempt=1, stream_seq=8, at=at)),
        make_run(publication=Publication(attempt=1, at=at)),  # its sequence not yet known
        make_run(status=RunStatus.FINISHED),
    ] + [make_run(publication=Publication(attempt=1, stream_seq=100 + i, at=at)) for i in range(8)]
    for doc in docs:
        await run_store.create_run(doc)
    want = {
        d.run_id: (
            d.attempt,
            d.publication.attempt if d.publication else None,
            d.publication.stream_seq if d.publication else None,
        )
        for d in docs
        if d.status is RunStatus.QUEUED
    }
    query = RunQuery(statuses=[RunStatus.QUEUED], limit=5)
    got: dict[str, tuple[int, int | None, int | None]] = {}
    sizes = []
    after: str | None = None
    for _ in range(10):  # bounded: a paging bug must fail, not hang
        page = await run_store.list_run_copies(dataclasses.replace(query, after_run_id=after))
        runs = await run_store.list_runs(dataclasses.replace(query, after_run_id=after))
        assert [c.run_id for c in page.copies] == [r.run_id for r in runs.runs]
        assert page.next_after == runs.next_after
        sizes.append(len(page.copies))
        got.update({c.run_id: (c.attempt, c.published_attempt, c.stream_seq) for c in page.copies})
        if page.next_after is None:
            break
        after = page.next_after
    assert sizes == [5, 5, 2]
    assert got == want


async def test_list_run_copies_carries_each_runs_status_and_failure_code(
    run_store: RunStore, make_run: MakeRun
) -> None:
    """So the sweeper passes over a run parked for a person without reading it."""
    parked = make_run(status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    queued = make_run()
    for doc in (parked, queued):
        await run_store.create_run(doc)
    page = await run_store.list_run_copies(
        RunQuery(statuses=[RunStatus.FAILED_RESUMABLE, RunStatus.QUEUED], limit=10)
    )
    got = {c.run_id: (c.status, c.failure_code) for c in page.copies}
    assert got == {
        parked.run_id: ("failed_resumable", "DLQ_PARKED"),
        queued.run_id: ("queued", None),
    }


async def test_a_query_by_run_ids_finds_exactly_those_runs_and_keeps_the_other_filters(
    run_store: RunStore, make_run: MakeRun
):
    """The publisher looks up a batch of its launches in one read (issue 19): the named runs
    that exist, none other, with every other filter still applied."""
    at = utcnow()
    docs = [make_run(publication=Publication(attempt=1, stream_seq=i, at=at)) for i in range(6)]
    docs.append(make_run(status=RunStatus.FINISHED))
    for doc in docs:
        await run_store.create_run(doc)
    asked = [docs[0].run_id, docs[2].run_id, docs[5].run_id, docs[6].run_id, "no-such-run"]
    page = await run_store.list_run_copies(RunQuery(run_ids=asked, limit=len(asked)))
    assert sorted(c.run_id for c in page.copies) == sorted(asked[:4])
    assert {c.run_id: c.stream_seq for c in page.copies}[docs[2].run_id] == 2
    queued = await run_store.list_runs(RunQuery(run_ids=asked, statuses=[RunStatus.QUEUED]))
    assert sorted(r.run_id for r in queued.runs) == sorted(asked[:3])


async def test_a_run_whose_outputs_hold_nan_is_still_listed_by_every_query(
    run_store: RunStore, make_run: MakeRun
):
    """A compute node may output NaN or an infinity (`float('nan')`, `10 ** 400` as a float).
    The run keeps it, and no query that filters or projects documents fails on it: SQLite's
    JSON functions refuse `NaN`, so one such run once failed every sweeper pass."""
    at = utcnow()
    odd = make_run(
        status=RunStatus.RUNNING,
        publication=Publication(attempt=1, stream_seq=3, at=at),
        checkpoint=Checkpoint(outputs={"a": {"x": float("nan"), "y": float("inf")}}),
    )
    plain = make_run(status=RunStatus.RUNNING)
    for doc in (odd, plain):
        await run_store.create_run(doc)
    stored = await run_store.get_run(odd.run_id)
    assert stored.checkpoint is not None
    x, y = stored.checkpoint.outputs["a"]["x"], stored.checkpoint.outputs["a"]["y"]
    assert math.isnan(x) and y == float("inf")
    page = await run_store.list_run_copies(RunQuery(statuses=[RunStatus.RUNNING]))
    assert {c.run_id for c in page.copies} == {odd.run_id, plain.run_id}
    named = await run_store.list_runs(RunQuery(workflow=odd.workflow.name))
    assert odd.run_id in {r.run_id for r in named.runs}


# -- events ------------------------------------------------------------------------------------


async def test_twenty_appenders_times_fifty_events_get_gap_free_sequences(
    run_store: RunStore, make_run: MakeRun
):
    doc = await run_store.create_run(make_run())

    async def appender(a: int) -> list[int]:
        seqs = []
        for n in range(50):
            event = await run_store.append_event(
                doc.run_id, "node_finished", {"appender": a, "n": n}, attempt=1, execution="tok"
            )
            seqs.append(event.seq)
        return seqs

    per_appender = await asyncio.gather(*(appender(a) for a in range(20)))

    returned = sorted(s for seqs in per_appender for s in seqs)
    assert returned == list(range(1, 1001))
    for seqs in per_appender:
        assert seqs == sorted(seqs)

    read: list[Any] = []
    after = 0
    for _ in range(20):  # bounded
        page = await run_store.read_events(doc.run_id, after_seq=after, limit=100)
        if not page:
            break
        read.extend(page)
        after = page[-1].seq
    assert [e.seq for e in read] == list(range(1, 1001))
    by_seq = {e.seq: (e.data["appender"], e.data["n"]) for e in read}
    assert len(set(by_seq.values())) == 1000
    for a, seqs in enumerate(per_appender):
        assert [by_seq[s] for s in seqs] == [(a, n) for n in range(50)]


async def test_appenders_on_separate_store_instances_get_gap_free_sequences(
    run_store: RunStore, make_run: MakeRun, store_backend: Backend
):
    """Across processes only the unique `(run_id, seq)` index arbitrates (SPEC §6.3)."""
    stores = [run_store, *[await store_backend.open_another() for _ in range(3)]]
    doc = await run_store.create_run(make_run())

    async def appender(a: int) -> list[int]:
        store = stores[a % len(stores)]
        return [
            (await store.append_event(doc.run_id, "node_started", {"a": a, "n": n})).seq
            for n in range(25)
        ]

    per_appender = await asyncio.gather(*(appender(a) for a in range(8)))
    assert sorted(s for seqs in per_appender for s in seqs) == list(range(1, 201))
    for store in stores:
        events = await store.read_events(doc.run_id, limit=1000)
        assert [e.seq for e in events] == list(range(1, 201))
    # An instance that has appended before continues the sequence after the others' appends.
    last = await stores[1].append_event(doc.run_id, "run_finished")
    assert last.seq == 201


async def test_read_events_returns_only_events_after_the_given_seq(
    run_store: RunStore, make_run: MakeRun
):
    run = await run_store.create_run(make_run())
    other = await run_store.create_run(make_run())
    before = utcnow()
    for i in range(5):
        await run_store.append_event(run.run_id, "node_started", {"node": f"n{i}"})
    await run_store.append_event(other.run_id, "run_launched", {"workflow": "hello"})
    first = await run_store.append_event(
        run.run_id, "run_claimed", {"path": "fresh"}, attempt=2, execution="tok-2"
    )
    assert first.seq == 6

    events = await run_store.read_events(run.run_id, after_seq=3)
    assert [e.seq for e in events] == [4, 5, 6]
    assert [e.data for e in events[:2]] == [{"node": "n3"}, {"node": "n4"}]
    last = events[-1]
    assert last == first
    assert (last.type, last.attempt, last.execution) == ("run_claimed", 2, "tok-2")
    assert last.at.utcoffset() == timedelta(0)
    assert last.at >= before
    assert await run_store.read_events(run.run_id, after_seq=6) == []
    assert [e.seq for e in await run_store.read_events(run.run_id, after_seq=0, limit=2)] == [1, 2]
    assert [e.seq for e in await run_store.read_events(other.run_id)] == [1]


async def test_read_events_before_reads_from_the_newest_back(
    run_store: RunStore, make_run: MakeRun
):
    """The readers after a run's latest event of a kind (a parked run's record, the retry
    since the last claim) read back from the newest instead of the whole history."""
    run = await run_store.create_run(make_run())
    other = await run_store.create_run(make_run())
    for i in range(5):
        await run_store.append_event(run.run_id, "node_started", {"node": f"n{i}"})
    await run_store.append_event(other.run_id, "run_launched", {"workflow": "hello"})

    newest = await run_store.read_events_before(run.run_id, limit=2)
    assert [e.seq for e in newest] == [5, 4]
    assert newest[0].data == {"node": "n4"}
    assert [e.seq for e in await run_store.read_events_before(run.run_id, before_seq=4)] == [
        3,
        2,
        1,
    ]
    assert await run_store.read_events_before(run.run_id, before_seq=1) == []
    assert [e.seq for e in await run_store.read_events_before(other.run_id)] == [1]
    assert await run_store.read_events_before("no-such-run") == []
    paged = [e.seq async for e in events_newest_first(run_store, run.run_id, page=2)]
    assert paged == [5, 4, 3, 2, 1]


# -- interactions ------------------------------------------------------------------------------


def interaction(run_id: str, *, text: str = "Proceed?", ident: str | None = None) -> Interaction:
    return Interaction(
        id=ident or str(uuid.uuid4()),
        run_id=run_id,
        node="ask",
        attempt=1,
        questions=[{"id": "q1", "text": text}],
        created_at=utcnow(),
    )


async def test_put_interaction_is_idempotent(run_store: RunStore, make_run: MakeRun):
    run = await run_store.create_run(make_run())
    first = interaction(run.run_id, text="first")
    assert await run_store.put_interaction(first) == first
    again = await run_store.put_interaction(interaction(run.run_id, text="again", ident=first.id))
    assert again == first
    assert await run_store.list_interactions(run.run_id) == [first]


async def test_answer_interaction_succeeds_once_then_returns_none(
    run_store: RunStore, make_run: MakeRun
):
    run = await run_store.create_run(make_run())
    asked = await run_store.put_interaction(interaction(run.run_id))
    at = utcnow()

    answered = await run_store.answer_interaction(asked.id, {"q1": "yes"}, at)
    assert answered is not None
    assert answered.status == InteractionStatus.ANSWERED
    assert answered.answers == {"q1": "yes"}
    assert answered.answered_at == at

    assert await run_store.answer_interaction(asked.id, {"q1": "no"}, utcnow()) is None
    assert await run_store.answer_interaction("no-such-interaction", {"q1": "x"}, at) is None
    [stored] = await run_store.list_interactions(run.run_id)
    assert stored == answered


async def test_concurrent_answers_to_one_interaction_have_one_winner(
    run_store: RunStore, make_run: MakeRun
):
    run = await run_store.create_run(make_run())
    asked = await run_store.put_interaction(interaction(run.run_id))
    at = utcnow()
    results = await asyncio.gather(
        *(run_store.answer_interaction(asked.id, {"q1": f"a{i}"}, at) for i in range(10))
    )
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    [stored] = await run_store.list_interactions(run.run_id)
    assert stored.answers == winners[0].answers


async def test_retire_interactions_retires_only_the_runs_pending_ones(
    run_store: RunStore, make_run: MakeRun
):
    run = await run_store.create_run(make_run())
    other = await run_store.create_run(make_run())
    pending = [await run_store.put_interaction(interaction(run.run_id)) for _ in range(2)]
    done = await run_store.put_interaction(interaction(run.run_id))
    await run_store.answer_interaction(done.id, {"q1": "yes"}, utcnow())
    elsewhere = await run_store.put_interaction(interaction(other.run_id))

    assert {i.id for i in await run_store.list_interactions(run.run_id, pending_only=True)} == {
        i.id for i in pending
    }
    assert await run_store.retire_interactions(run.run_id) == 2
    assert await run_store.list_interactions(run.run_id, pending_only=True) == []
    statuses = {i.id: i.status for i in await run_store.list_interactions(run.run_id)}
    assert statuses == {
        pending[0].id: InteractionStatus.RETIRED,
        pending[1].id: InteractionStatus.RETIRED,
        done.id: InteractionStatus.ANSWERED,
    }
    assert await run_store.answer_interaction(pending[0].id, {"q1": "late"}, utcnow()) is None
    assert await run_store.retire_interactions(run.run_id) == 0
    assert await run_store.list_interactions(other.run_id, pending_only=True) == [elsewhere]


# -- staged uploads ----------------------------------------------------------------------------


def staged(tenant: str, created_at: datetime) -> StagedUpload:
    upload_id = secrets.token_hex(16)
    return StagedUpload(
        id=upload_id,
        tenant=tenant,
        files=[
            StagedFile(
                name="data",
                filename="data.csv",
                bytes=3,
                sha256=hashlib.sha256(b"a,b").hexdigest(),
                key=f"uploads/{upload_id}/data.csv",
            )
        ],
        created_at=created_at,
    )


async def test_staged_uploads_are_scoped_to_their_tenant(run_store: RunStore):
    record = staged("acme", utcnow())
    await run_store.put_staged_upload(record)

    assert await run_store.get_staged_upload(record.id, "acme") == record
    assert await run_store.get_staged_upload(record.id, "globex") is None
    assert await run_store.delete_staged_upload(record.id, "globex") is False
    assert await run_store.get_staged_upload(record.id, "acme") == record

    assert await run_store.delete_staged_upload(record.id, "acme") is True
    assert await run_store.get_staged_upload(record.id, "acme") is None
    assert await run_store.delete_staged_upload(record.id, "acme") is False


async def test_a_staged_upload_is_claimed_by_one_run_at_a_time(run_store: RunStore):
    """SPEC §8 "used once": of concurrent promotions, one claim wins; the claim is the
    tenant's, survives a re-claim by its own run, and a release gives the upload back."""
    record = staged("acme", utcnow())
    await run_store.put_staged_upload(record)

    wins = await asyncio.gather(
        *(run_store.claim_staged_upload(record.id, "acme", f"run-{i}") for i in range(8))
    )
    assert sum(wins) == 1
    holder = await run_store.get_staged_upload(record.id, "acme")
    assert holder is not None and holder.claimed_by == f"run-{wins.index(True)}"
    winner = holder.claimed_by
    assert await run_store.claim_staged_upload(record.id, "acme", winner) is True
    assert await run_store.claim_staged_upload(record.id, "globex", "run-x") is False
    assert await run_store.claim_staged_upload("no-such-upload", "acme", "run-x") is False

    assert await run_store.release_staged_upload(record.id, "acme", "run-x") is False
    assert await run_store.release_staged_upload(record.id, "globex", winner) is False
    assert await run_store.release_staged_upload(record.id, "acme", winner) is True
    released = await run_store.get_staged_upload(record.id, "acme")
    assert released is not None and released.claimed_by is None
    assert await run_store.claim_staged_upload(record.id, "acme", "run-x") is True


async def test_put_staged_upload_is_create_only(run_store: RunStore):
    record = staged("acme", utcnow())
    await run_store.put_staged_upload(record)
    hijack = record.model_copy(update={"tenant": "globex"})
    with pytest.raises(StoreError):
        await run_store.put_staged_upload(hijack)
    assert await run_store.get_staged_upload(record.id, "acme") == record
    assert await run_store.get_staged_upload(record.id, "globex") is None


async def test_list_staged_uploads_before_sees_every_tenant_and_respects_cutoff(
    run_store: RunStore,
):
    now = utcnow()
    old_a = staged("acme", now - timedelta(hours=2))
    old_b = staged("globex", now - timedelta(hours=1))
    fresh = staged("acme", now)
    for record in (fresh, old_b, old_a):
        await run_store.put_staged_upload(record)

    listed = await run_store.list_staged_uploads_before(now - timedelta(minutes=1))
    assert [r.id for r in listed] == [old_a.id, old_b.id]
    assert listed == [old_a, old_b]
    assert len(await run_store.list_staged_uploads_before(now + timedelta(seconds=1), limit=2)) == 2


# -- locks -------------------------------------------------------------------------------------


async def test_try_lock_refuses_a_second_owner_until_expiry_and_the_owner_renews(
    run_store: RunStore,
):
    t0 = utcnow()
    ttl = 10.0
    assert await run_store.try_lock("sweeper", "a", t0, ttl) is True
    assert await run_store.try_lock("sweeper", "b", t0 + timedelta(seconds=5), ttl) is False
    # The owner renews: the lock now runs to t0 + 15 s.
    assert await run_store.try_lock("sweeper", "a", t0 + timedelta(seconds=5), ttl) is True
    assert await run_store.try_lock("sweeper", "b", t0 + timedelta(seconds=12), ttl) is False
    assert await run_store.try_lock("sweeper", "b", t0 + timedelta(seconds=15), ttl) is True
    assert await run_store.try_lock("sweeper", "a", t0 + timedelta(seconds=16), ttl) is False
    # Locks are independent by name.
    assert await run_store.try_lock("backstop", "a", t0 + timedelta(seconds=16), ttl) is True


# -- delete ------------------------------------------------------------------------------------


async def test_delete_run_removes_its_events_and_interactions(
    run_store: RunStore, make_run: MakeRun
):
    run = await run_store.create_run(make_run())
    other = await run_store.create_run(make_run())
    for target in (run, other):
        for i in range(3):
            await run_store.append_event(target.run_id, "node_started", {"node": f"n{i}"})
        await run_store.put_interaction(interaction(target.run_id))

    assert await run_store.delete_run(run.run_id) is True
    with pytest.raises(RunNotFound):
        await run_store.get_run(run.run_id)
    assert await run_store.read_events(run.run_id) == []
    assert await run_store.list_interactions(run.run_id) == []
    assert await run_store.delete_run(run.run_id) is False

    assert await run_store.get_run(other.run_id) == other
    assert [e.seq for e in await run_store.read_events(other.run_id)] == [1, 2, 3]
    assert len(await run_store.list_interactions(other.run_id)) == 1


async def test_ping_answers(run_store: RunStore):
    await run_store.ping()


# -- SQLite only -------------------------------------------------------------------------------


async def test_sqlite_corrupt_file_raises_store_corrupt_and_is_not_overwritten(tmp_path: Path):
    path = tmp_path / "runs.db"
    garbage = b"this is not a SQLite database, it is a text file someone left here\n" * 64
    path.write_bytes(garbage)
    with pytest.raises(StoreCorrupt):
        await SqliteRunStore.open(path)
    assert path.read_bytes() == garbage


async def test_sqlite_document_that_is_not_json_raises_store_corrupt(
    tmp_path: Path, make_run: MakeRun
):
    path = tmp_path / "runs.db"
    store = await SqliteRunStore.open(path)
    try:
        doc = await store.create_run(make_run())
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("UPDATE runs SET doc = '{not json' WHERE run_id = ?", (doc.run_id,))
        with pytest.raises(StoreCorrupt, match=doc.run_id):
            await store.get_run(doc.run_id)
    finally:
        await store.close()


async def test_status_counts_count_runs_per_status_and_tenant(
    run_store: RunStore, make_run: MakeRun
) -> None:
    from store import RunStatus as S

    await run_store.create_run(make_run())
    await run_store.create_run(make_run())
    await run_store.create_run(make_run(tenant="other"))
    counts = await run_store.status_counts()
    assert counts == {S.QUEUED: 3}
    assert await run_store.status_counts(tenant="other") == {S.QUEUED: 1}
    assert await run_store.status_counts(tenant="nobody") == {}
