"""The lease refresh is one narrow write (issue 19 lever 2; SPEC §2, §5.4): a keeper's beat sets
`lease.expires_at` on its token and nothing else, on every backend, and each store writes it in
place: SQLite with its JSON functions, MongoDB with one `find_one_and_update` and no pre-read.
Whatever the narrow write does not take (another token, a gone run, a text SQLite's JSON
functions would rewrite) gets the general compare-and-set's answer."""

from __future__ import annotations

import math
import sqlite3
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from store.cas import CasConflict, Eq, Update
from store.errors import RunNotFound
from store.models import Lease, RunDocument, RunStatus
from store.mongo import MongoRunStore
from store.protocols import RunQuery, RunStore
from store.sqlite import SqliteRunStore
from store.timeutil import to_ms, utcnow
from tests.store.conftest import Backend, MakeRun


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
        with closing(sqlite3.connect(path)) as conn, conn:
            (text,) = conn.execute(
                "SELECT doc FROM runs WHERE run_id = ?", (run.run_id,)
            ).fetchone()
            planted = text.replace('"x":7', '"x":1.0e5')
            assert planted != text
            conn.execute("UPDATE runs SET doc = ? WHERE run_id = ?", (planted, run.run_id))
        update = refresh()

        refreshed = await store.update_run(run.run_id, [Eq("lease.token", "tok")], update)

        assert isinstance(refreshed, RunDocument) and refreshed.inputs == {"x": 100000.0}
        with closing(sqlite3.connect(path)) as conn:
            (after,) = conn.execute(
                "SELECT doc FROM runs WHERE run_id = ?", (run.run_id,)
            ).fetchone()
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
    calls: list[str] = []
    real_io = store._io

    async def counted(what: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        return await real_io(what, fn, *args, **kwargs)

    monkeypatch.setattr(store, "_io", counted)
    refreshed = await store.update_run(run.run_id, [Eq("lease.token", "tok")], refresh())
    assert isinstance(refreshed, RunDocument)
    assert calls == ["refresh lease"]
