"""The DLQ routes of the HTTP API (SPEC §3 records, §4 Replay, v2.2 §10c): list, show, replay
and purge through `runner.operations.dlq`, each record its run's tenant's; a record no run can
be found for (a poison body) is the fleet tenant's (`RUNFLEET_TENANT`)."""

from __future__ import annotations

from publisher import DlqStore
from store import RunStatus
from tests.console.conftest import OP_B, Api
from tests.operations.test_dlq import parked, poison, record_for


async def test_dlq_list_show_replay_and_purge_act_on_the_callers_records(api: Api) -> None:
    dlq: DlqStore = api.fleet.dlq
    run = await parked(api.env)
    replayable = await record_for(dlq, run, 11)
    bad = await poison(dlq, 12)

    status, listed, _ = await api.call("GET", "/api/v1/dlq")
    assert status == 200 and [r["id"] for r in listed["records"]] == [11, 12]
    _, only, _ = await api.call("GET", "/api/v1/dlq", params={"reason": "malformed"})
    assert [r["id"] for r in only["records"]] == [12]
    status, shown, _ = await api.call("GET", "/api/v1/dlq/11", template="/api/v1/dlq/{record_id}")
    assert status == 200 and shown["message"]["run_id"] == run.run_id
    _, poisoned, _ = await api.call("GET", "/api/v1/dlq/12", template="/api/v1/dlq/{record_id}")
    assert poisoned["message"] is None and poisoned["undecodable"]

    status, report, _ = await api.call("POST", "/api/v1/dlq/replay", json={"all": True})
    assert status == 200
    outcomes = {o["id"]: o for o in report["outcomes"]}
    assert outcomes[replayable.id]["run"]["status"] == "queued"
    assert outcomes[bad.id]["error"]["code"] == "record_not_replayable"
    assert (await api.env.store.get_run(run.run_id)).status is RunStatus.QUEUED

    status, purged, _ = await api.call("POST", "/api/v1/dlq/purge", json={"ids": [bad.id]})
    assert status == 200 and purged == {"purged": [bad.id]}
    assert [r.id for r in await dlq.list()] == []


async def test_a_parked_runs_status_names_the_record_it_waits_on_as_the_cli_does(
    api: Api,
) -> None:
    """`runfleet status --json` had `dlq_record`; the API's run did not (an on-call walkthrough),
    so a service could not find a parked run's way back."""
    run = await parked(api.env)
    await record_for(api.fleet.dlq, run, 31)
    await api.env.store.append_event(
        run.run_id,
        "run_dlq_parked",
        {"reason": "retries_exhausted", "record_id": 31},
        attempt=run.attempt,
    )
    template = "/api/v1/runs/{run_id}"
    status, shown, _ = await api.call("GET", f"/api/v1/runs/{run.run_id}", template=template)
    assert status == 200 and shown["dlq_record"] == 31
    await api.fleet.dlq.delete(31)  # purged: the way back is a resume, and no id is offered
    _, again, _ = await api.call("GET", f"/api/v1/runs/{run.run_id}", template=template)
    assert again["dlq_record"] is None


async def test_a_replay_that_replays_nothing_answers_the_refusals_status_not_200(
    api: Api,
) -> None:
    """Found by an operator walkthrough: a refused replay answered 200 with the refusal inside,
    so a caller reading only the status took it for done (the CLI exits 3 for it)."""
    bad = await poison(api.fleet.dlq, 31)

    status, body, _ = await api.call("POST", "/api/v1/dlq/replay", json={"ids": [bad.id]})

    assert status == 409, body
    assert body["error"]["code"] == "record_not_replayable"
    assert body["error"]["message"].startswith(f"no record was replayed: {bad.id}: ")
    assert body["error"]["remedy"]
    assert [r.id for r in await api.fleet.dlq.list()] == [bad.id]  # nothing was touched


async def test_show_says_a_replay_would_be_refused_before_anyone_tries_it(api: Api) -> None:
    """Found by an operator walkthrough: `dlq show` said "replayable yes" for a record whose
    run had moved on, and the replay was then refused `stale_record`. Show judges it the way
    replay does (`publisher.replay.replay_refusal`), here and in the CLI."""
    from runner.cli.dlq import detail_lines, detail_view
    from runner.operations import show_record

    dlq: DlqStore = api.fleet.dlq
    run = await parked(api.env)
    current = await record_for(dlq, run, 41)
    stale = await record_for(dlq, run.model_copy(update={"attempt": 1}), 42)
    template = "/api/v1/dlq/{record_id}"

    _, fine, _ = await api.call("GET", f"/api/v1/dlq/{current.id}", template=template)
    _, old, _ = await api.call("GET", f"/api/v1/dlq/{stale.id}", template=template)
    status, refused, _ = await api.call("POST", "/api/v1/dlq/replay", json={"ids": [stale.id]})

    assert fine["replay_refusal"] is None
    assert old["replay_refusal"]["code"] == "stale_record" == refused["error"]["code"]
    assert status == 409
    lines = detail_lines(detail_view(await show_record(api.env, stale.id)))
    (said,) = [ln for ln in lines if ln.startswith("replayable")]
    assert "no: [stale_record] DLQ record 42 is for attempt 1" in said


async def test_a_record_without_a_run_is_the_fleet_tenants_only(api: Api) -> None:
    bad = await poison(api.fleet.dlq, 21)

    _, theirs, _ = await api.call("GET", "/api/v1/dlq", token=OP_B)
    status, body, _ = await api.call("POST", "/api/v1/dlq/purge", token=OP_B, json={"ids": [21]})

    assert theirs["records"] == []
    assert status == 404 and body["error"]["code"] == "record_not_found"
    assert [r.id for r in await api.fleet.dlq.list()] == [bad.id]


async def test_a_selection_must_name_ids_or_all(api: Api) -> None:
    for payload in ({}, {"ids": [1], "all": True}, {"all": True, "older_than": "1d"}):
        status, body, _ = await api.call("POST", "/api/v1/dlq/replay", json=payload)
        assert status == 400 and body["error"]["code"] == "invalid_request", payload
    status, body, _ = await api.call(
        "POST", "/api/v1/dlq/purge", json={"all": True, "older_than": "soon"}
    )
    assert status == 400 and "older_than" in body["error"]["message"]


async def test_the_dlq_list_pages_by_id_over_the_callers_records_only(api: Api) -> None:
    """A DLQ of thousands came back as one answer of megabytes: the list pages by record id,
    and a page is filled with the caller's records, another tenant's skipped, not counted."""
    dlq: DlqStore = api.fleet.dlq
    run = await parked(api.env)
    for record_id in (31, 32, 34):
        await record_for(dlq, run, record_id)
    await poison(dlq, 33)  # the fleet tenant's, which is the caller's here

    _, first, _ = await api.call("GET", "/api/v1/dlq", params={"limit": 2})
    _, second, _ = await api.call(
        "GET", "/api/v1/dlq", params={"limit": 2, "after": first["next_after"]}
    )
    _, theirs, _ = await api.call("GET", "/api/v1/dlq", params={"limit": 1}, token=OP_B)

    assert [r["id"] for r in first["records"]] == [31, 32] and first["next_after"] == 32
    assert [r["id"] for r in second["records"]] == [33, 34] and second["next_after"] is None
    assert theirs == {"records": [], "next_after": None}
    status, body, _ = await api.call("GET", "/api/v1/dlq", params={"limit": 0})
    assert status == 400 and body["error"]["code"] == "invalid_request"
