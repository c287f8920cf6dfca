"""`GET /api/v1/runs?after=RUN` (SPEC v2.2 §10c) shares `runfleet runs --after`'s operation: an
`after` no run of the caller's tenant has is `run_not_found` (404), never a page from wherever
the string sorts; another tenant's run is not found either (a token learns nothing of it)."""

from __future__ import annotations

from store import RunStatus
from tests.console.conftest import Api
from tests.publisher.conftest import put_run

UNKNOWN = "01ffffff-0000-7000-8000-000000000000"


async def test_list_after_a_run_the_caller_cannot_see_is_run_not_found(api: Api) -> None:
    store = api.env.store
    older = await put_run(store, status=RunStatus.FINISHED)
    newer = await put_run(store, status=RunStatus.FINISHED)
    theirs = await put_run(store, status=RunStatus.FINISHED, tenant="b")

    status, page, _ = await api.call("GET", "/api/v1/runs", params={"after": newer.run_id})
    assert status == 200 and older.run_id in [r["run_id"] for r in page["runs"]]
    assert newer.run_id not in [r["run_id"] for r in page["runs"]]

    for after in (UNKNOWN, theirs.run_id):
        status, body, _ = await api.call("GET", "/api/v1/runs", params={"after": after})
        assert status == 404, body
        assert body["error"]["code"] == "run_not_found" and after in body["error"]["message"]
