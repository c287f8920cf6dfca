"""The SQLite compare-and-set, optimistic first (ADR-0009 amendment 4): judged and encoded
outside the write lock, written only if the row still holds the text it read; a row that moved
in between is judged again under the lock. The race is forced here: a second store (another
process's connection, in effect) writes the run between the first store's read and its write.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from store.cas import CasConflict, Eq, Update
from store.errors import UnwritablePath
from store.models import RunDocument, RunStatus
from store.protocols import EventDraft
from store.sqlite import SqliteRunStore
from store.sqlite.runs import _Remembered
from tests.store.conftest import MakeRun


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[SqliteRunStore, SqliteRunStore]]:
    first = await SqliteRunStore.open(tmp_path / "runs.db")
    second = await SqliteRunStore.open(tmp_path / "runs.db")
    yield first, second
    await first.close()
    await second.close()


def race_before_first_write(
    store: SqliteRunStore, rival: Callable[[], Awaitable[Any]]
) -> list[str]:
    """Run `rival` once, right before `store`'s next write transaction; the names of the write
    functions `store` ran, in order."""
    original = store._write
    ran: list[str] = []

    async def write(fn: Callable[[sqlite3.Connection], Any]) -> Any:
        if not ran:
            await rival()
        ran.append(getattr(fn, "__name__", "?"))
        return await original(fn)

    store._write = write  # type: ignore[method-assign]
    return ran


def draft(kind: str) -> EventDraft:
    return EventDraft(type=kind, data={})


async def start_if_queued(store: SqliteRunStore, run_id: str) -> RunDocument | CasConflict:
    return await store.update_run(
        run_id,
        [Eq("status", RunStatus.QUEUED)],
        Update(set={"status": RunStatus.RUNNING}),
        events=[draft("run_claimed")],
    )


async def cancel_queued(store: SqliteRunStore, run_id: str, event: str) -> None:
    """Another writer's move on the row: queued → cancelled, with `event`; it must land."""
    won = await store.update_run(
        run_id,
        [Eq("status", RunStatus.QUEUED)],
        Update(set={"status": RunStatus.CANCELLED}),
        events=[draft(event)],
    )
    assert not isinstance(won, CasConflict)


async def test_a_cas_whose_row_moved_after_its_read_is_judged_again_and_conflicts_on_the_new_row(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    first, second = stores
    run = make_run()
    await first.create_run(run)

    async def claim_elsewhere() -> None:
        await cancel_queued(second, run.run_id, "run_cancelled")

    ran = race_before_first_write(first, claim_elsewhere)
    lost = await start_if_queued(first, run.run_id)
    assert ran == ["optimistic", "locked"]  # the optimistic write found the row moved
    assert isinstance(lost, CasConflict)
    assert lost.current is not None and lost.current.status is RunStatus.CANCELLED
    stored = await first.get_run(run.run_id)
    assert stored.status is RunStatus.CANCELLED
    assert [e.type for e in await first.read_events(run.run_id)] == ["run_cancelled"]


async def test_a_cas_whose_row_moved_but_still_matches_lands_on_top_of_the_other_write(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    first, second = stores
    run = make_run()
    await first.create_run(run)

    async def note_elsewhere() -> None:
        done = await second.update_run(
            run.run_id, [], Update(set={"error": "noted elsewhere"}), events=[draft("noted")]
        )
        assert not isinstance(done, CasConflict)

    ran = race_before_first_write(first, note_elsewhere)
    landed = await start_if_queued(first, run.run_id)
    assert ran == ["optimistic", "locked"]
    assert not isinstance(landed, CasConflict)
    assert landed.status is RunStatus.RUNNING and landed.error == "noted elsewhere"
    stored = await first.get_run(run.run_id)
    assert stored == landed  # the other write's field is kept, not overwritten by a stale copy
    events = await first.read_events(run.run_id)
    assert [(e.seq, e.type) for e in events] == [(1, "noted"), (2, "run_claimed")]


async def test_a_cas_whose_row_did_not_move_writes_once_outside_the_lock_judgement(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    first, _ = stores
    run = make_run()
    await first.create_run(run)

    async def nothing() -> None:
        return None

    ran = race_before_first_write(first, nothing)
    landed = await start_if_queued(first, run.run_id)
    assert ran == ["optimistic"] and not isinstance(landed, CasConflict)
    assert (await first.get_run(run.run_id)).status is RunStatus.RUNNING


def count_point_reads(store: SqliteRunStore) -> list[int]:
    """A one-item counter of `store`'s point reads from now on."""
    original = store._point_read
    reads = [0]

    async def point_read(fn: Callable[[sqlite3.Connection], Any]) -> Any:
        reads[0] += 1
        return await original(fn)

    store._point_read = point_read  # type: ignore[method-assign]
    return reads


async def test_a_cas_after_a_read_of_the_same_run_judges_the_text_read_without_reading_again(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    """A runner reads a run to admit it, then claims it, then finishes it: the claim and the
    finish judge the text this store last read or wrote (issue 19, twelfth pass)."""
    first, _ = stores
    run = make_run()
    await first.create_run(run)
    await first.get_run(run.run_id)
    reads = count_point_reads(first)
    ran = race_before_first_write(first, _nothing)
    claimed = await start_if_queued(first, run.run_id)
    finished = await first.update_run(
        run.run_id, [Eq("status", RunStatus.RUNNING)], Update(set={"status": RunStatus.FINISHED})
    )
    assert not isinstance(claimed, CasConflict) and not isinstance(finished, CasConflict)
    assert reads == [0]
    assert ran == ["remembered_write", "remembered_write"]
    assert (await first.get_run(run.run_id)).status is RunStatus.FINISHED


async def test_a_cas_on_a_remembered_text_that_another_store_changed_conflicts_on_the_new_row(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    first, second = stores
    run = make_run()
    await first.create_run(run)
    await first.get_run(run.run_id)  # remembered: queued
    await cancel_queued(second, run.run_id, "cancel")
    lost = await start_if_queued(first, run.run_id)
    assert isinstance(lost, CasConflict)
    assert lost.current is not None and lost.current.status is RunStatus.CANCELLED
    assert [e.type for e in await first.read_events(run.run_id)] == ["cancel"]


async def test_a_conflict_found_on_a_remembered_text_is_judged_again_on_the_row_as_it_is(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    """The remembered text says the condition fails; the row, changed by another process,
    says it holds: the answer is the row's."""
    first, second = stores
    run = make_run()
    await first.create_run(run)
    await first.get_run(run.run_id)  # remembered: queued
    started = await start_if_queued(second, run.run_id)
    assert not isinstance(started, CasConflict)
    reads = count_point_reads(first)
    done = await first.update_run(
        run.run_id, [Eq("status", RunStatus.RUNNING)], Update(set={"status": RunStatus.FINISHED})
    )
    assert not isinstance(done, CasConflict) and done.status is RunStatus.FINISHED
    assert reads == [1]  # the fresh read that overruled the remembered text


async def test_an_update_the_remembered_text_refuses_is_judged_again_on_the_row_as_it_is(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    """The remembered text has no `scratch`, so `scratch.forsaken` cannot be set on it; another
    process has since written one. The row as it is accepts the update, so it lands: a refusal
    judged on a stale text is no more an answer than a conflict judged on one (found by review)."""
    first, second = stores
    run = make_run()
    await first.create_run(run)
    await first.get_run(run.run_id)  # remembered: scratch is null
    banked = {"state": "banked", "key": "k", "bytes": 1, "progress": 1}
    won = await second.update_run(
        run.run_id, [Eq("status", RunStatus.QUEUED)], Update(set={"scratch": banked})
    )
    assert not isinstance(won, CasConflict)
    done = await first.update_run(
        run.run_id, [Eq("status", RunStatus.QUEUED)], Update(set={"scratch.forsaken": True})
    )
    assert not isinstance(done, CasConflict)
    assert done.scratch is not None and done.scratch.forsaken and done.scratch.key == "k"
    assert (await second.get_run(run.run_id)).scratch.forsaken  # type: ignore[union-attr]


async def test_an_update_the_row_itself_refuses_still_raises_after_a_remembered_text(
    stores: tuple[SqliteRunStore, SqliteRunStore], make_run: MakeRun
) -> None:
    """The fallback is a fresh judgement, not a swallowed error: when the row as it is refuses
    the update too, the caller hears the typed refusal."""
    first, _ = stores
    run = make_run()
    await first.create_run(run)
    await first.get_run(run.run_id)  # remembered: scratch is null, and so is the row
    with pytest.raises(UnwritablePath):
        await first.update_run(
            run.run_id, [Eq("status", RunStatus.QUEUED)], Update(set={"scratch.forsaken": True})
        )


async def _nothing() -> None:
    return None


def test_the_remembered_texts_are_bounded_and_forget_the_oldest_first() -> None:
    remembered = _Remembered(size=3)
    for n in range(5):
        remembered.keep(f"run-{n}", f"text-{n}")
    remembered.keep("run-2", "text-2b")  # kept again: now the newest
    remembered.keep("run-5", "text-5")
    assert [remembered.take(f"run-{n}") for n in range(6)] == [
        None,
        None,
        "text-2b",
        None,
        "text-4",
        "text-5",
    ]
    assert remembered.take("run-4") is None  # taken once
