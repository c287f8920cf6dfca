"""How failures read over the HTTP API (SPEC v2.2 §10c): typed refusals as 4xx with the CLI's
error body and codes, unreachable infrastructure as 503 with `Retry-After`, one table."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import runner.console  # noqa: F401 - imports every operation, so every refusal is registered
from runner.console import create_app
from runner.console.errors import REFUSAL_STATUS, RETRY_AFTER_S
from runner.operations import Env
from store import Refusal, RunStatus
from store.errors import _CODES
from tests.console.conftest import OP_A, TOKENS, Api, fleet_env, validate
from tests.publisher.conftest import EXAMPLES, put_run
from tests.runner.conftest import Fleet

HELLO = (EXAMPLES / "hello.yaml").read_text()


def refusal_codes() -> dict[str, type[Refusal]]:
    import importlib

    out: dict[str, type[Refusal]] = {}
    for code, owner in _CODES.items():
        module, _, qualname = owner.rpartition(".")
        cls = getattr(importlib.import_module(module), qualname, None)
        if isinstance(cls, type) and issubclass(cls, Refusal):
            out[code] = cls
    return out


def test_refusals_map_to_one_status_each_by_kind_of_code() -> None:
    codes = refusal_codes()
    assert {"run_not_found", "answers_invalid", "run_not_resumable"} <= set(codes)
    for code in codes:
        status = REFUSAL_STATUS.get(code, 400)
        if code.endswith("_not_found"):
            assert status == 404, code
        elif code.startswith("answers_"):
            assert status == 422, code
        else:
            assert status in (400, 409), code


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def api_without_nats(fleet: Fleet) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    env = fleet_env(fleet)
    wire = fleet.wire.model_copy(update={"nats_url": f"nats://127.0.0.1:{dead_port()}"})
    down = Env(env.settings, env.engine_settings, env.store, env.blobs, env.client, wire)
    async with TestClient(TestServer(create_app(down, TOKENS))) as client:
        yield client


async def test_nats_unreachable_is_503_with_retry_after(
    api_without_nats: TestClient[web.Request, web.Application], fleet: Fleet
) -> None:
    auth = {"Authorization": f"Bearer {OP_A}"}
    paused = await put_run(fleet.store, status=RunStatus.PAUSED_OPERATOR)
    calls = [
        ("POST", "/api/v1/runs", "/api/v1/runs", {"workflow": HELLO}),
        ("POST", f"/api/v1/runs/{paused.run_id}/cancel", "/api/v1/runs/{run_id}/cancel", None),
        ("GET", "/api/v1/dlq", "/api/v1/dlq", None),
    ]
    for method, path, template, payload in calls:
        resp = await api_without_nats.request(method, path, headers=auth, json=payload)
        body = await resp.json()
        assert resp.status == 503, (path, body)
        assert resp.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert body["error"]["code"] in ("nats_unavailable", "nats_timeout")
        validate(template, method, 503, body)
    # the store answers still: a read that needs no NATS works
    resp = await api_without_nats.get(f"/api/v1/runs/{paused.run_id}", headers=auth)
    assert resp.status == 200


async def test_unknown_routes_and_methods_answer_the_error_shape(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body, _ = await api.call("DELETE", "/api/v1/runs")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body, _ = await api.call("POST", "/api/v1/runs", data=b"not json")
    assert status == 400 and body["error"]["code"] == "invalid_request"
    status, body, _ = await api.call("GET", "/api/v1/dlq/abc", template="/api/v1/dlq/{record_id}")
    assert status == 400 and body["error"]["code"] == "invalid_request"
