"""`/healthz`, `/readyz`, `/metrics` (SPEC §5.8) over HTTP on the runner's own port."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from runner.runner import Runner
from store.settings import SettingsInvalid
from tests.runner.callables import bound_drain, idle_runner, workflow
from tests.runner.conftest import Fleet, eventually

DELIVERED = 'runfleet_deliveries_total{disposition="ack",reason="finished"}'


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def get(http: aiohttp.ClientSession, runner: Runner, path: str) -> tuple[int, Any]:
    assert runner.http is not None
    async with http.get(f"http://127.0.0.1:{runner.http.port}{path}") as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


def sample_line(text: str, prefix: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_healthz_and_readyz_answer_200_on_a_running_runner(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    status, health = await get(http, runner, "/healthz")
    assert status == 200 and health["ok"] is True
    assert health["owner"] == runner.owner and health["draining"] is False
    status, ready = await get(http, runner, "/readyz")
    assert (status, ready) == (200, {"ok": True, "problems": []})


async def test_readyz_answers_503_while_draining(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    assert (await get(http, runner, "/readyz"))[0] == 200
    assert runner.svc is not None
    runner.svc.draining = True  # what SIGTERM's shutdown sets first, before it hands off
    status, ready = await get(http, runner, "/readyz")
    assert status == 503
    assert ready == {"ok": False, "problems": ["draining"]}
    # Alive all the same: draining is not a reason to be restarted.
    assert (await get(http, runner, "/healthz"))[0] == 200


async def test_healthz_answers_503_when_the_fetch_loop_makes_no_progress(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    # No fetch loop at all (it never consumes): nothing marks progress. Next to it, a runner
    # whose fetch loop turns over (every 0.5 s) with the same 1 s window.
    stalled = await idle_runner(fleet, owner="stalled", healthy_within="1s")
    assert (await get(http, stalled, "/healthz"))[0] == 200
    live = await fleet.start_runner(sweeper=False, backstop=False, healthy_within="1s")

    async def unhealthy() -> bool:
        status, body = await get(http, stalled, "/healthz")
        return status == 503 and body["ok"] is False

    await eventually(unhealthy, within=5)
    status, body = await get(http, live, "/healthz")
    assert status == 200 and body["ok"] is True


async def test_metrics_show_deliveries_moving_after_a_run(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    status, text = await get(http, runner, "/metrics")
    assert status == 200
    assert sample_line(text, DELIVERED) is None
    run = await fleet.launch(workflow("hello").source)
    await fleet.wait_status(run.run_id, "finished")

    async def counted() -> float | None:
        return sample_line((await get(http, runner, "/metrics"))[1], DELIVERED)

    assert await eventually(counted) == 1.0
    text = (await get(http, runner, "/metrics"))[1]
    assert sample_line(text, 'runfleet_claims_total{outcome="won",path="fresh"}') == 1.0
    assert sample_line(text, "runfleet_queue_wait_seconds_count") == 1.0


async def test_a_health_port_in_use_is_a_usage_error_naming_the_setting(fleet: Fleet) -> None:
    """An operator walkthrough: `error [internal]: OSError(98 …)`, and `up` restarted the
    runner in a loop; it is the setting's fault, said as such (the CLI's exit 2)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SettingsInvalid) as caught:
            await fleet.start_runner(http_port=port)
    assert f"RUNFLEET_HTTP_PORT={port}" in caught.value.message
    assert "free port" in (caught.value.remedy or "")
