"""The run routes of the HTTP API (SPEC v2.2 §10c) against a real fleet: each answers what the
operation it calls returns, shaped as `/openapi.json` says (`Api.call` validates every answer)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from runner.console import sse
from runner.console.api import idempotent_run_id
from store import RunStatus
from tests.console.conftest import Api
from tests.publisher.conftest import EXAMPLES, put_run

HELLO = (EXAMPLES / "hello.yaml").read_text()
APPROVAL = (EXAMPLES / "approval.yaml").read_text()
RUN = "/api/v1/runs/{run_id}"


async def launch(api: Api, source: str = HELLO, **kwargs: Any) -> dict[str, Any]:
    status, body, _ = await api.call("POST", "/api/v1/runs", json={"workflow": source}, **kwargs)
    assert status == 201, body
    return dict(body)


async def test_launch_queues_a_run_for_the_callers_tenant_and_status_shows_it(api: Api) -> None:
    run = await launch(api)
    assert (run["status"], run["attempt"], run["tenant"]) == ("queued", 1, "default")

    status, shown, _ = await api.call("GET", f"/api/v1/runs/{run['run_id'][:10]}", template=RUN)
    assert status == 200 and shown["run_id"] == run["run_id"]
    assert (await api.env.store.get_run(run["run_id"])).status is RunStatus.QUEUED


async def test_launch_with_an_idempotency_key_returns_the_first_run_for_a_retry(api: Api) -> None:
    key = {"Idempotency-Key": "order-1234"}
    status, first, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO}, headers=key)
    again, second, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO}, headers=key)
    other, third, _ = await api.call(
        "POST", "/api/v1/runs", json={"workflow": HELLO}, headers={"Idempotency-Key": "order-9"}
    )

    assert (status, again, other) == (201, 200, 201)
    assert second["run_id"] == first["run_id"] == idempotent_run_id("default", "order-1234")
    assert third["run_id"] != first["run_id"]
    assert await api.fleet.stream_messages() == 2  # the retry queued nothing


async def test_an_idempotency_key_reused_for_another_launch_is_refused_422(api: Api) -> None:
    key = {"Idempotency-Key": "order-77"}
    status, first, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO}, headers=key)
    other_vars, by_vars, _ = await api.call(
        "POST", "/api/v1/runs", json={"workflow": HELLO, "vars": {"name": "x"}}, headers=key
    )
    other_source, by_source, _ = await api.call(
        "POST", "/api/v1/runs", json={"workflow": APPROVAL}, headers=key
    )
    retry, again, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO}, headers=key)

    assert (status, other_vars, other_source, retry) == (201, 422, 422, 200)
    for refused, differs in ((by_vars, "vars"), (by_source, "workflow")):
        assert refused["error"]["code"] == "idempotency_key_reused"
        assert first["run_id"] in refused["error"]["message"]
        assert differs in refused["error"]["message"] and refused["error"]["remedy"]
    assert again["run_id"] == first["run_id"]
    assert await api.fleet.stream_messages() == 1  # neither refused request queued anything


async def test_launch_of_a_workflow_that_does_not_load_is_refused_400(api: Api) -> None:
    status, body, _ = await api.call("POST", "/api/v1/runs", json={"workflow": "name: [unclosed"})
    assert status == 400 and body["error"]["code"] == "workflow_invalid"
    status, body, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO, "x": 1})
    assert status == 400 and body["error"]["code"] == "invalid_request"
    status, body, _ = await api.call(
        "POST", "/api/v1/runs", json={"workflow": HELLO, "vars": {"nope": 1}}
    )
    assert status == 400 and body["error"]["code"] == "vars_invalid"


async def test_list_filters_by_status_and_code_and_pages_newest_first(api: Api) -> None:
    store = api.env.store
    parked = [
        await put_run(store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
        for _ in range(3)
    ]
    await put_run(store, status=RunStatus.FAILED_RESUMABLE, failure_code="OTHER")
    await put_run(store, status=RunStatus.PAUSED_OPERATOR)
    query = [("status", "failed_resumable"), ("code", "DLQ_PARKED"), ("limit", "2")]

    status, first, _ = await api.call("GET", "/api/v1/runs", params=query)
    _, rest, _ = await api.call(
        "GET", "/api/v1/runs", params=[*query, ("after", first["next_after"])]
    )

    assert status == 200
    seen = [r["run_id"] for r in [*first["runs"], *rest["runs"]]]
    assert seen == [r.run_id for r in reversed(parked)]
    assert rest["next_after"] is None
    status, body, _ = await api.call("GET", "/api/v1/runs", params={"status": "nope"})
    assert status == 400 and body["error"]["code"] == "invalid_request"
    status, body, _ = await api.call("GET", "/api/v1/runs", params={"since": "yesterday"})
    assert status == 400 and "since" in body["error"]["message"]


async def test_events_page_by_seq_and_the_stream_follows_to_the_end(api: Api) -> None:
    await api.fleet.start_runner()
    run = await launch(api)
    await api.fleet.wait_status(run["run_id"], "finished")
    path = f"/api/v1/runs/{run['run_id']}/events"

    _, first, _ = await api.call("GET", path, params={"limit": 2}, template=RUN + "/events")
    _, rest, _ = await api.call(
        "GET", path, params={"after": first["next_after"]}, template=RUN + "/events"
    )
    seqs = [e["seq"] for e in first["events"] + rest["events"]]
    assert sorted(seqs) == list(range(1, len(seqs) + 1)) and len(first["events"]) == 2
    assert rest["next_after"] is None

    resp = await api.client.get(
        path + "/stream", headers={"Authorization": "Bearer token-operate-a"}
    )
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = await resp.text()
    frames = [f for f in text.split("\n\n") if f.strip()]
    data = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [d["seq"] for d in data[:-1]] == [e["seq"] for e in first["events"] + rest["events"]]
    assert frames[-1].startswith("event: end") and data[-1]["status"] == "finished"


async def test_an_events_page_reads_only_what_it_needs_not_the_rest_of_the_run(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale drill: each page of a 40 000-event run read every event after `after`, so
    paging through it read the run forty times over."""
    from runner.operations import runs as runs_module

    await api.fleet.start_runner()
    run = await launch(api)
    await api.fleet.wait_status(run["run_id"], "finished")
    monkeypatch.setattr(runs_module, "EVENTS_PAGE", 2)
    reads: list[int] = []
    read_events = api.env.store.read_events

    async def counted(run_id: str, **kwargs: Any) -> Any:
        got = await read_events(run_id, **kwargs)
        reads.append(len(got))
        return got

    monkeypatch.setattr(api.env.store, "read_events", counted)
    path = f"/api/v1/runs/{run['run_id']}/events"

    _, first, _ = await api.call("GET", path, params={"limit": 2}, template=RUN + "/events")

    assert [e["seq"] for e in first["events"]] == [1, 2] and first["next_after"] == 2
    assert len(reads) == 2  # two pages of two: this page's two events, and that more follow


async def test_resume_without_answers_is_422_and_with_them_resumes(api: Api) -> None:
    await api.fleet.start_runner()
    run = await launch(api, APPROVAL)
    paused = await api.fleet.wait_status(run["run_id"], "paused_waiting_human")
    path = f"/api/v1/runs/{paused.run_id}/resume"

    status, body, _ = await api.call("POST", path, json={}, template=RUN + "/resume")
    assert status == 422 and body["error"]["code"] == "answers_required"
    # The remedy speaks HTTP, not the CLI's flags (found by an operator walkthrough).
    assert '"answers"' in body["error"]["remedy"] and "--answer" not in body["error"]["remedy"]
    status, body, _ = await api.call(
        "POST", path, json={"answers": {"approved": True}}, template=RUN + "/resume"
    )
    assert status == 200 and body["status"] in ("queued", "running", "finished")
    done = await api.fleet.wait_status(paused.run_id, "finished")
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["accepted"]["decision"] == "approved"
    # What it consumed, which a budget is checked against, is in the API's run too.
    _, shown, _ = await api.call("GET", f"/api/v1/runs/{paused.run_id}", template=RUN)
    assert shown["usage"]["iterations"] == done.checkpoint.usage.iterations > 0


async def test_cancel_and_rewind_answer_their_refusals_as_409(api: Api) -> None:
    finished = await put_run(api.env.store, status=RunStatus.FINISHED)
    base = f"/api/v1/runs/{finished.run_id}"
    status, body, _ = await api.call("POST", base + "/cancel", template=RUN + "/cancel")
    assert status == 409 and body["error"]["code"] == "run_not_cancellable"
    status, body, _ = await api.call(
        "POST", base + "/rewind", json={"node": "greet"}, template=RUN + "/rewind"
    )
    assert status == 409 and body["error"]["code"] == "rewind_refused"

    queued = await launch(api)
    status, body, _ = await api.call(
        "POST", f"/api/v1/runs/{queued['run_id']}/cancel", template=RUN + "/cancel"
    )
    assert status == 200 and body["status"] == "cancelled"


async def test_an_unknown_run_is_404_run_not_found(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/runs/no-such-run", template=RUN)
    assert status == 404
    assert body["error"]["code"] == "run_not_found" and body["error"]["remedy"]


async def test_the_stream_keeps_a_quiet_run_alive_and_ends_when_it_stops_moving(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.1)
    run = await launch(api)  # no runner: it stays queued, and quiet
    auth = {"Authorization": "Bearer token-operate-a"}
    resp = await api.client.get(f"/api/v1/runs/{run['run_id']}/events/stream", headers=auth)
    lines: list[bytes] = []

    async def until(marker: bytes) -> None:
        while marker not in lines:
            line = await asyncio.wait_for(resp.content.readline(), 10)
            assert line, f"the stream ended before {marker!r}: {lines}"
            lines.append(line.strip())

    await until(b": keep-alive")
    status, _, _ = await api.call(
        "POST", f"/api/v1/runs/{run['run_id']}/cancel", template=RUN + "/cancel"
    )
    assert status == 200
    await until(b"event: end")
    end = json.loads((await resp.content.readline()).decode().removeprefix("data: "))
    assert end["status"] == "cancelled"
    seqs = [json.loads(x.decode()[6:])["seq"] for x in lines if x.startswith(b"data: ")]
    assert seqs == sorted(seqs) and len(seqs) >= 2  # launched, queued (, cancelled)


async def test_a_runs_filter_naming_no_failure_code_is_400(api: Api) -> None:
    """A mistyped code matched nothing and read as "no such runs" (a newcomer's walkthrough)."""
    status, body, _ = await api.call("GET", "/api/v1/runs?code=TOOL_FAILED_TRANSI")
    assert status == 400 and "is not a failure code" in body["error"]["message"]
    status, _, _ = await api.call("GET", "/api/v1/runs?code=TOOL_FAILED_TRANSIENT")
    assert status == 200
