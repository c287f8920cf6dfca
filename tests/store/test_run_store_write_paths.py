"""The `RunStore` contract on write paths (SPEC §2 "Write conditions", §5.3, §9): every backend
stores the same document for the same write, and refuses alike what a real `mongod` refuses.

A `mongod` refuses `$set` of `a.b` when `a` is null or not a sub-document, and an update whose
paths overlap; mongomock drops or merges such a write silently and a dict walk (SQLite) would
overwrite the parent. The store refuses them on every backend (`UnwritablePath`) before writing,
so a caller that writes under a possibly-null parent fails here, not on a production server.
Part of the conformance suite: `run_store` / `store_backend` run each test on every backend.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from runner.admission import DeliveryInfo
from runner.claim import claim
from store.cas import CasConflict, Eq, Update
from store.codec import encode
from store.errors import UnwritablePath
from store.models import RunStatus
from store.protocols import RunStore
from store.timeutil import to_ms, utcnow
from tests.store.conftest import MONGO_BACKENDS, open_backend

if TYPE_CHECKING:
    from tests.store.conftest import Backend, MakeRun

TTL, SKEW = timedelta(seconds=30), timedelta(seconds=2)
DELIVERY = DeliveryInfo(stream_seq=17, num_delivered=1, max_deliver=5)
PER_WRITE = ("updated_at",)
"""Stamped by the store at the write: the one field two backends cannot share."""


@pytest.mark.parametrize("mongo", MONGO_BACKENDS)
async def test_a_claim_before_the_publication_write_stores_one_document_on_sqlite_and_mongo(
    mongo: str, tmp_path: Path, make_run: MakeRun
) -> None:
    """SPEC §5.3: the claim's own CAS (runner.claim, exactly as a runner sends it) on a queued
    run whose `publication` is still null, as when the claim beats the publisher's write."""
    run = make_run()
    assert run.publication is None
    now = utcnow()
    stored: dict[str, dict[str, Any]] = {}
    async with (
        open_backend("sqlite", tmp_path) as sqlite,
        open_backend(mongo, tmp_path) as other,
    ):
        for backend in (sqlite, other):
            await backend.store.create_run(run)
            won = await claim(
                backend.store, run, "fresh", DELIVERY, owner="runner-a", now=now, ttl=TTL, skew=SKEW
            )
            assert not isinstance(won, CasConflict)
            raw = await backend.get_raw_run(run.run_id)
            assert raw is not None
            raw["lease"]["token"] = "<per claim>"  # a fresh uuid per claim
            stored[backend.name] = raw
    sqlite_doc, mongo_doc = stored["sqlite"], stored[mongo]
    assert sorted(sqlite_doc) == sorted(mongo_doc)
    for field in sorted(sqlite_doc):
        if field not in PER_WRITE:
            assert (field, mongo_doc[field]) == (field, sqlite_doc[field])
    assert sqlite_doc["publication"] == {
        "attempt": 1,
        "stream_seq": DELIVERY.stream_seq,
        "at": to_ms(now),
        "msg_id": None,
    }


async def test_a_dotted_set_under_a_null_parent_is_refused_and_nothing_is_written(
    store_backend: Backend, make_run: MakeRun
) -> None:
    run = make_run()
    await store_backend.store.create_run(run)
    before = await store_backend.get_raw_run(run.run_id)
    assert before is not None and before["publication"] is None
    dotted = Update(set={"publication.attempt": 1, "publication.stream_seq": 17})
    with pytest.raises(UnwritablePath, match="'publication' is null"):
        await store_backend.store.update_run(run.run_id, [Eq("attempt", 1)], dotted)
    assert await store_backend.get_raw_run(run.run_id) == before


async def test_a_dotted_set_under_a_scalar_parent_is_refused_and_nothing_is_written(
    store_backend: Backend, make_run: MakeRun
) -> None:
    run = make_run(error="a plain string")
    await store_backend.store.create_run(run)
    before = await store_backend.get_raw_run(run.run_id)
    with pytest.raises(UnwritablePath, match="'error' is a str"):
        await store_backend.store.update_run(run.run_id, [], Update(set={"error.detail": "x"}))
    assert await store_backend.get_raw_run(run.run_id) == before


async def test_a_dotted_set_under_an_absent_parent_creates_it_on_every_backend(
    store_backend: Backend, make_run: MakeRun
) -> None:
    """What `mongod` does too: only a *present* non-document parent is refused."""
    raw = encode(make_run())
    del raw["publication"]
    await store_backend.put_raw_run(raw)
    at = to_ms(utcnow())
    fields = {"publication.attempt": 1, "publication.stream_seq": 17, "publication.at": at}
    done = await store_backend.store.update_run(raw["run_id"], [], Update(set=fields))
    assert not isinstance(done, CasConflict)
    stored = await store_backend.get_raw_run(raw["run_id"])
    assert stored is not None
    assert stored["publication"] == {"attempt": 1, "stream_seq": 17, "at": at}


async def test_the_whole_publication_object_is_accepted_where_the_parent_is_null(
    run_store: RunStore, make_run: MakeRun
) -> None:
    run = make_run()
    await run_store.create_run(run)
    now = utcnow()
    whole = {"publication": {"attempt": 1, "stream_seq": 17, "at": now}}
    done = await run_store.update_run(run.run_id, [], Update(set=whole, bump_version=False))
    assert not isinstance(done, CasConflict)
    assert done.publication is not None
    assert (done.publication.attempt, done.publication.stream_seq) == (1, 17)
    assert (await run_store.get_run(run.run_id)).publication == done.publication


@pytest.mark.parametrize(
    "update",
    [
        Update(set={"publication": None, "publication.attempt": 1}),
        Update(set={"lease": None}, unset=["lease"]),
        Update(set={"cancel_requested": True}, unset=["lease", "lease.token"]),
    ],
    ids=["set-parent-and-child", "set-and-unset-one-path", "unset-parent-and-child"],
)
async def test_a_write_whose_paths_overlap_is_refused_and_nothing_is_written(
    store_backend: Backend, make_run: MakeRun, update: Update
) -> None:
    run = make_run()
    await store_backend.store.create_run(run)
    before = await store_backend.get_raw_run(run.run_id)
    with pytest.raises(UnwritablePath, match=r"overlap|both set and unset"):
        await store_backend.store.update_run(run.run_id, [], update)
    assert await store_backend.get_raw_run(run.run_id) == before


async def test_a_refused_path_is_judged_after_the_conditions_so_a_lost_race_is_a_conflict(
    run_store: RunStore, make_run: MakeRun
) -> None:
    """Both backends evaluate the conditions first: a write that could not apply anyway is a
    `CasConflict` (a race), never the programming-error refusal."""
    run = make_run()
    await run_store.create_run(run)
    dotted = Update(set={"publication.attempt": 1})
    lost = await run_store.update_run(run.run_id, [Eq("status", RunStatus.RUNNING)], dotted)
    assert isinstance(lost, CasConflict)
