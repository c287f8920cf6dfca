"""The SQLite query columns follow the document through every kind of write, even though an
update only rewrites the columns it can change."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

from store.cas import Eq, Update
from store.models import Lease, RunDocument, RunStatus
from store.sqlite import SqliteRunStore
from store.timeutil import utcnow
from tests.store.conftest import MakeRun


def columns_match_doc(path: Path, run_id: str) -> dict[str, Any]:
    with closing(sqlite3.connect(path)) as conn:
        row = conn.execute(
            "SELECT tenant, status, origin, failure_code, lease_expires_ms, created_ms,"
            " updated_ms, doc FROM runs WHERE run_id = ?",
            (run_id,),
        ).fetchone()
    doc = json.loads(row[7])
    expected = (
        doc["tenant"],
        doc["status"],
        doc["origin"],
        doc.get("failure_code"),
        (doc.get("lease") or {}).get("expires_at"),
        doc["created_at"],
        doc["updated_at"],
    )
    assert tuple(row[:7]) == expected
    return doc


async def test_query_columns_follow_claim_refresh_status_and_release(
    tmp_path: Path, make_run: MakeRun
) -> None:
    path = tmp_path / "runs.db"
    store = await SqliteRunStore.open(path)
    try:
        run = await store.create_run(make_run())
        now = utcnow()
        lease = Lease(token="t", owner="o", attempt=1, stream_seq=1, expires_at=now)
        steps = [
            ([Eq("status", RunStatus.QUEUED)], Update(set={"status": "running", "lease": lease})),
            (
                [Eq("lease.token", "t")],
                Update(set={"lease.expires_at": now + timedelta(seconds=30)}, bump_version=False),
            ),
            (
                [Eq("status", RunStatus.RUNNING)],
                Update(set={"status": "failed_resumable", "failure_code": "SANDBOX_LOST"}),
            ),
            ([Eq("lease.token", "t")], Update(unset=["lease"])),
        ]
        for conditions, update in steps:
            result = await store.update_run(run.run_id, conditions, update)
            assert isinstance(result, RunDocument), (update, result)
            columns_match_doc(path, run.run_id)
        final = columns_match_doc(path, run.run_id)
        assert final.get("lease") is None
        assert final["status"] == "failed_resumable"
    finally:
        await store.close()
