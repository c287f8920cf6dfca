"""The narrow writes (issue 19 lever 2; SPEC §2, §5.4, §5.7; ADR-0008 amendments): the lease
refresh (a keeper's beat sets `lease.expires_at` on its token) and the publication record (after
each publish, `publication` set on the attempt published, unless it already names that stream
sequence), both without a version bump. Each store writes them in place: SQLite with its JSON
functions, MongoDB with one `find_one_and_update` and no pre-read; only the field set is
validated. Whatever a narrow write does not take (another token or attempt, the copy already
recorded, a gone run, a text SQLite's JSON functions would rewrite, a value that is not valid)
gets the general compare-and-set's answer."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from store.cas import CasConflict, Condition, Eq, Ne, Update
from store.errors import DocumentInvalid, RunNotFound
from store.models import Lease, Publication, RunDocument, RunStatus
from store.mongo import MongoRunStore
from store.protocols import RunQuery, RunStore
from store.sqlite import SqliteRunStore
from store.timeutil import to_ms, utcnow
from tests.store.conftest import Backend, MakeRun


def stored_text(path: Path, run_id: str) -> str:
    with closing(sqlite3.connect(path)) as conn:
        (text,) = conn.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return str(text)


def respell_x(path: Path, run_id: str) -> None:
    """Respell `"x":7` as `"x":1.0e5` in the stored text: a spelling the general path's encoder
    would change (orjson writes `100000.0`), so only an in-place write keeps it."""
    text = stored_text(path, run_id)
    planted = text.replace('"x":7', '"x":1.0e5')
    assert planted != text
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE runs SET doc = ? WHERE run_id = ?", (planted, run_id))


@contextmanager
def mongo_calls(store: MongoRunStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the round trips `store` makes inside the block."""
    calls: list[str] = []
    real_io = store._io

    async def counted(what: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        return await real_io(what, fn, *args, **kwargs)

    monkeypatch.setattr(store, "_io", counted)
    yield calls


# -- the lease refresh -----------------------------------------------------------------------


def held(token: str = "tok", *, seconds: float = 30.0) -> Lease:
    return Lease(
        owner="runner-a",
        token=token,
        attempt=1,
        stream_seq=7,
        expires_at=utcnow() + timedelta(seconds=seconds),
    )


def refresh(seconds: float = 90.0) -> Update:
    """What `LeaseKeeper.refresh_once` writes."""
    return Update(
        set={"lease.expires_at": utcnow() + timedelta(seconds=seconds)}, bump_version=False
    )


async def running(store: RunStore, make_run: MakeRun, **fields: Any) -> RunDocument:
    return await store.create_run(make_run(status=RunStatus.RUNNING, lease=held(), **fields))


async def test_a_lease_refresh_writes_only_the_lease_expiry(
    run_store: RunStore, make_run: MakeRun
) -> None:
    before = await running(
        run_store, make_run, inputs={"n": 3, "s": "é", "f": 0.1, "deep": {"l": [1, None]}}
    )
    update = refresh()
    until = update.set["lease.expires_at"]

    refreshed = await run_store.update_run(before.run_id, [Eq("lease.token", "tok")], update)

    assert before.lease is not None
    expected = before.model_copy(
        update={"lease": before.lease.model_copy(update={"expires_at": refreshed.lease.expires_at})}  # type: ignore[union-attr]
    )
    assert isinstance(refreshed, RunDocument)
    assert refreshed == expected  # no version bump, no `updated_at`, nothing else moved
    assert refreshed.lease is not None
    assert to_ms(refreshed.lease.expires_at) == to_ms(until)
    assert await run_store.get_run(before.run_id) == refreshed
    # The lease-expiry index sees the new expiry (the sweeper's and the adopter's queries).
    just_before = RunQuery(lease_expires_before=refreshed.lease.expires_at - timedelta(seconds=1))
    just_after = RunQuery(lease_expires_before=refreshed.lease.expires_at + timedelta(seconds=1))
    assert before.run_id not in [r.run_id for r in (await run_store.list_runs(just_before)).runs]
    assert before.run_id in [r.run_id for r in (await run_store.list_runs(just_after)).runs]


async def test_a_lease_refresh_by_a_token_that_does_not_hold_the_lease_writes_nothing(
    run_store: RunStore, make_run: MakeRun
) -> None:
    taken = await running(run_store, make_run)
    conflict = await run_store.update_run(taken.run_id, [Eq("lease.token", "other")], refresh())
    assert conflict == CasConflict(taken)

    free = await run_store.create_run(make_run(status=RunStatus.RUNNING))
    assert free.lease is None
    answer = await run_store.update_run(free.run_id, [Eq("lease.token", "tok")], refresh())
    assert answer == CasConflict(free)

    assert await run_store.get_run(taken.run_id) == taken
    assert await run_store.get_run(free.run_id) == free
    with pytest.raises(RunNotFound):
        await run_store.update_run("no-such-run", [Eq("lease.token", "tok")], refresh())


async def test_a_lease_refresh_keeps_the_rest_of_the_stored_text_byte_for_byte(
    tmp_path: Path, make_run: MakeRun
) -> None:
    """SQLite writes the one field in place: a number spelled in a way the general path's
    encoder would respell (`1.0e5`, which orjson writes `100000.0`) is still spelled so."""
    path = tmp_path / "runs.db"
    store = await SqliteRunStore.open(path)
    try:
        run = await running(store, make_run, inputs={"x": 7})
        respell_x(path, run.run_id)
        update = refresh()

        refreshed = await store.update_run(run.run_id, [Eq("lease.token", "tok")], update)

        assert isinstance(refreshed, RunDocument) and refreshed.inputs == {"x": 100000.0}
        after = stored_text(path, run.run_id)
        assert '"x":1.0e5' in after
        assert f'"expires_at":{to_ms(update.set["lease.expires_at"])}' in after
    finally:
        await store.close()


async def test_a_lease_refresh_of_a_run_holding_a_nan_keeps_the_nan(
    store_backend: Backend, make_run: MakeRun
) -> None:
    """A NaN a node wrote is `NaN` in SQLite's text, which its JSON functions refuse (a newer
    SQLite would write it back as `null`): that refresh takes the general path, and the NaN
    survives on every backend (with, on SQLite, an int past 64 bits, which MongoDB refuses)."""
    store = store_backend.store
    big = 2**70 if isinstance(store, SqliteRunStore) else 2**62
    run = await running(store, make_run, inputs={"x": math.nan, "big": big})
    update = refresh()
    until = update.set["lease.expires_at"]

    refreshed = await store.update_run(run.run_id, [Eq("lease.token", "tok")], update)

    assert isinstance(refreshed, RunDocument) and refreshed.lease is not None
    assert to_ms(refreshed.lease.expires_at) == to_ms(until)
    stored = await store.get_run(run.run_id)
    assert math.isnan(stored.inputs["x"]) and stored.inputs["big"] == big
    assert stored.lease is not None and to_ms(stored.lease.expires_at) == to_ms(until)


async def test_a_mongo_lease_refresh_is_one_write_with_no_pre_read(
    store_backend: Backend, make_run: MakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_backend.store
    if not isinstance(store, MongoRunStore):
        pytest.skip("MongoDB's round trips; SQLite's in-place write is the test above")
    run = await running(store, make_run)
    with mongo_calls(store, monkeypatch) as calls:
        refreshed = await store.update_run(run.run_id, [Eq("lease.token", "tok")], refresh())
    assert isinstance(refreshed, RunDocument)
    assert calls == ["refresh lease"]


# -- the publication record ------------------------------------------------------------------


def record(attempt: int, seq: int, *, at: datetime | None = None) -> tuple[list[Condition], Update]:
    """What `Publisher.record_publication` writes."""
    publication = {
        "attempt": attempt,
        "stream_seq": seq,
        "at": at or utcnow(),
        "msg_id": f"run:{attempt}",
    }
    return [Eq("attempt", attempt), Ne("publication.stream_seq", seq)], Update(
        set={"publication": publication}, bump_version=False
    )


async def queued(store: RunStore, make_run: MakeRun, **fields: Any) -> RunDocument:
    return await store.create_run(make_run(status=RunStatus.QUEUED, **fields))


async def test_a_publication_record_writes_only_the_publication(
    run_store: RunStore, make_run: MakeRun
) -> None:
    before = await queued(
        run_store, make_run, inputs={"n": 3, "s": "é", "f": 0.1, "deep": {"l": [1, None]}}
    )
    assert before.publication is None
    conditions, update = record(1, 41)

    recorded = await run_store.update_run(before.run_id, conditions, update)

    assert isinstance(recorded, RunDocument)
    expected = before.model_copy(
        update={"publication": Publication.model_validate(update.set["publication"])}
    )
    assert recorded == expected  # no version bump, no `updated_at`, nothing else moved
    assert await run_store.get_run(before.run_id) == recorded

    # A later copy of the same attempt (a sweeper's republish) replaces it whole.
    again = await run_store.update_run(before.run_id, *record(1, 42))
    assert isinstance(again, RunDocument) and again.publication is not None
    assert again.publication.stream_seq == 42 and again.version == before.version


async def test_a_publication_record_that_does_not_hold_writes_nothing(
    run_store: RunStore, make_run: MakeRun
) -> None:
    run = await queued(run_store, make_run)
    recorded = await run_store.update_run(run.run_id, *record(1, 41))
    assert isinstance(recorded, RunDocument)

    # The copy is already recorded (a claim recorded its own delivery first).
    assert await run_store.update_run(run.run_id, *record(1, 41)) == CasConflict(recorded)
    # The attempt moved on.
    assert await run_store.update_run(run.run_id, *record(2, 43)) == CasConflict(recorded)
    assert await run_store.get_run(run.run_id) == recorded
    with pytest.raises(RunNotFound):
        await run_store.update_run("no-such-run", *record(1, 41))


async def test_a_publication_that_is_not_valid_is_refused_as_before(
    run_store: RunStore, make_run: MakeRun
) -> None:
    """The narrow write validates the one field it sets; a value that fails goes to the general
    path, which refuses the write and names the field."""
    run = await queued(run_store, make_run)
    conditions, update = record(1, 41)
    bad = Update(
        set={"publication": {**update.set["publication"], "attempt": 0}}, bump_version=False
    )

    with pytest.raises(DocumentInvalid, match="publication"):
        await run_store.update_run(run.run_id, conditions, bad)
    assert await run_store.get_run(run.run_id) == run


async def test_a_publication_record_keeps_the_rest_of_the_stored_text_byte_for_byte(
    tmp_path: Path, make_run: MakeRun
) -> None:
    """SQLite writes the one field in place: a number spelled in a way the general path's
    encoder would respell (`1.0e5`, which orjson writes `100000.0`) is still spelled so."""
    path = tmp_path / "runs.db"
    store = await SqliteRunStore.open(path)
    try:
        run = await queued(store, make_run, inputs={"x": 7})
        respell_x(path, run.run_id)

        recorded = await store.update_run(run.run_id, *record(1, 41))

        assert isinstance(recorded, RunDocument) and recorded.inputs == {"x": 100000.0}
        assert recorded.publication is not None and recorded.publication.stream_seq == 41
        after = stored_text(path, run.run_id)
        assert '"x":1.0e5' in after
        assert '"stream_seq":41' in after
    finally:
        await store.close()


async def test_a_publication_record_of_a_run_holding_a_nan_keeps_the_nan(
    store_backend: Backend, make_run: MakeRun
) -> None:
    """A text SQLite's JSON functions would rewrite takes the general path there; the NaN
    survives on every backend."""
    store = store_backend.store
    run = await queued(store, make_run, inputs={"x": math.nan})

    recorded = await store.update_run(run.run_id, *record(1, 41))

    assert isinstance(recorded, RunDocument) and recorded.publication is not None
    stored = await store.get_run(run.run_id)
    assert math.isnan(stored.inputs["x"])
    assert stored.publication is not None and stored.publication.stream_seq == 41


async def test_a_mongo_publication_record_is_one_write_with_no_pre_read(
    store_backend: Backend, make_run: MakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_backend.store
    if not isinstance(store, MongoRunStore):
        pytest.skip("MongoDB's round trips; SQLite's in-place write is the test above")
    run = await queued(store, make_run)
    with mongo_calls(store, monkeypatch) as calls:
        recorded = await store.update_run(run.run_id, *record(1, 41))
    assert isinstance(recorded, RunDocument)
    assert calls == ["record publication"]
