"""`list_runs` newest first and by workflow name, on every backend (SPEC §10 v2.2: `runs`
lists newest first and filters by workflow; §10b the console's runs page does the same)."""

from __future__ import annotations

from store import RunQuery, RunStore
from tests.store.conftest import MakeRun, workflow_ref


async def test_list_runs_newest_first_pages_every_run_once_in_descending_order(
    run_store: RunStore, make_run: MakeRun
) -> None:
    ids = [(await run_store.create_run(make_run())).run_id for _ in range(25)]

    seen: list[str] = []
    after: str | None = None
    for _ in range(10):  # bounded: a paging bug must fail, not hang
        page = await run_store.list_runs(RunQuery(after_run_id=after, limit=10, newest_first=True))
        seen.extend(r.run_id for r in page.runs)
        if page.next_after is None:
            break
        after = page.next_after

    assert seen == sorted(ids, reverse=True)


async def test_list_runs_filters_by_workflow_name(run_store: RunStore, make_run: MakeRun) -> None:
    hello = [(await run_store.create_run(make_run())).run_id for _ in range(2)]
    other = await run_store.create_run(make_run(workflow=workflow_ref(name="approval")))

    page = await run_store.list_runs(RunQuery(workflow="approval"))
    assert [r.run_id for r in page.runs] == [other.run_id]
    page = await run_store.list_runs(RunQuery(workflow="hello", newest_first=True))
    assert [r.run_id for r in page.runs] == sorted(hello, reverse=True)
    assert (await run_store.list_runs(RunQuery(workflow="nope"))).runs == []
