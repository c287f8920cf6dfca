"""The publication record is one narrow write (issue 19 lever 2; SPEC §2, §5.7): after each
publish, `Publisher.record_publication` sets `publication` on the attempt it published, unless
it already names that stream sequence, without a version bump. Each store writes it in place
(SQLite with its JSON functions, MongoDB with one `find_one_and_update` and no pre-read),
validating only the `Publication` it sets. Whatever the narrow write does not take (another
attempt, the copy already recorded, a gone run, a value that is not a `Publication`) gets the
general compare-and-set's answer."""

from __future__ import annotations

import math
import sqlite3
from contextlib import closing
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from store.cas import CasConflict, Condition, Eq, Ne, Update
from store.errors import DocumentInvalid, RunNotFound
from store.models import Publication, RunDocument, RunStatus
from store.mongo import MongoRunStore
from store.protocols import RunStore
from store.sqlite import SqliteRunStore
from store.timeutil import utcnow
from tests.store.conftest import Backend, MakeRun


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
        with closing(sqlite3.connect(path)) as conn, conn:
            (text,) = conn.execute(
                "SELECT doc FROM runs WHERE run_id = ?", (run.run_id,)
            ).fetchone()
            planted = text.replace('"x":7', '"x":1.0e5')
            assert planted != text
            conn.execute("UPDATE runs SET doc = ? WHERE run_id = ?", (planted, run.run_id))

        recorded = await store.update_run(run.run_id, *record(1, 41))

        assert isinstance(recorded, RunDocument) and recorded.inputs == {"x": 100000.0}
        assert recorded.publication is not None and recorded.publication.stream_seq == 41
        with closing(sqlite3.connect(path)) as conn:
            (after,) = conn.execute(
                "SELECT doc FROM runs WHERE run_id = ?", (run.run_id,)
            ).fetchone()
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
    calls: list[str] = []
    real_io = store._io

    async def counted(what: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        return await real_io(what, fn, *args, **kwargs)

    monkeypatch.setattr(store, "_io", counted)
    recorded = await store.update_run(run.run_id, *record(1, 41))
    assert isinstance(recorded, RunDocument)
    assert calls == ["record publication"]
