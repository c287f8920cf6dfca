"""SPEC §3: the message carries the W3C `traceparent` "when present". The HTTP API is where a
caller's trace context arrives (an audit found nothing passed it on): a launch or a resume
over the API puts the request's `traceparent` on the message it queues; a malformed one is
ignored, as W3C Trace Context says, never refused."""

from __future__ import annotations

from typing import Any

from publisher.wire import HDR_ATTEMPT, HDR_TRACEPARENT
from tests.console.conftest import Api
from tests.console.test_api_runs import APPROVAL, HELLO
from tests.runner.callables import bound_drain
from tests.runner.conftest import eventually

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def queued_headers(api: Api, seq: int) -> dict[str, str]:
    msg = await api.fleet.js.get_msg(api.fleet.names.runs_stream, seq)
    return dict(msg.headers or {})


async def last_seq(api: Api) -> int:
    info = await api.fleet.js.stream_info(api.fleet.names.runs_stream)
    return int(info.state.last_seq)


async def test_traceparent_a_launch_carries_the_requests_trace_context_on_its_message(
    api: Api,
) -> None:
    status, run, _ = await api.call(
        "POST", "/api/v1/runs", json={"workflow": HELLO}, headers={"traceparent": PARENT}
    )
    assert status == 201, run
    headers = await queued_headers(api, await last_seq(api))
    assert headers[HDR_TRACEPARENT] == PARENT

    status, _, _ = await api.call("POST", "/api/v1/runs", json={"workflow": HELLO})
    assert status == 201
    assert HDR_TRACEPARENT not in await queued_headers(api, await last_seq(api))


async def test_traceparent_a_resume_carries_the_requests_trace_context(api: Api) -> None:
    await api.fleet.start_runner()
    status, run, _ = await api.call("POST", "/api/v1/runs", json={"workflow": APPROVAL})
    assert status == 201
    await api.fleet.wait_status(run["run_id"], "paused_waiting_human")
    bound_drain(api.fleet.runners)
    for runner in api.fleet.runners:  # so the resume's message stays on the stream to read
        await runner.shutdown()
    status, resumed, _ = await api.call(
        "POST",
        f"/api/v1/runs/{run['run_id']}/resume",
        json={"answers": {"approved": True}},
        headers={"traceparent": PARENT},
        template="/api/v1/runs/{run_id}/resume",
    )
    assert status == 200, resumed

    async def copy() -> dict[str, Any] | None:
        headers = await queued_headers(api, await last_seq(api))
        return headers if headers.get(HDR_ATTEMPT) == "2" else None

    assert (await eventually(copy, within=10))[HDR_TRACEPARENT] == PARENT


async def test_traceparent_a_malformed_one_is_ignored_not_refused(api: Api) -> None:
    for bad in ("not-a-trace", "ff-" + PARENT[3:], "00-" + "0" * 32 + PARENT[35:]):
        status, run, _ = await api.call(
            "POST", "/api/v1/runs", json={"workflow": HELLO}, headers={"traceparent": bad}
        )
        assert status == 201, (bad, run)
        assert HDR_TRACEPARENT not in await queued_headers(api, await last_seq(api))
