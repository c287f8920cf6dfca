"""How failures read over the HTTP API (SPEC v2.2 §10c): typed refusals as 4xx with the CLI's
error body and codes, unreachable infrastructure as 503 with `Retry-After`, one table."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import runner.console  # noqa: F401 - imports every operation, so every refusal is registered
from runner.cli.errors import EXIT_REFUSED, EXIT_USAGE, exit_code_for
from runner.console import create_app
from runner.console.errors import REFUSAL_STATUS, RETRY_AFTER_S, status_for
from runner.operations import Env
from store import Refusal, RunStatus
from store.errors import _CODES, RunfleetError
from store.staging import StagedUploadInvalid, StagedUploadNotFound
from tests.console.conftest import OP_A, TOKENS, Api, fleet_env, validate
from tests.publisher.conftest import EXAMPLES, put_run
from tests.runner.conftest import Fleet

HELLO = (EXAMPLES / "hello.yaml").read_text()


def error_classes() -> dict[str, type[RunfleetError]]:
    """The product's errors by code (a class a test defines, in a function or not, is not one:
    `tests.test_error_tree` registers some while it runs)."""
    import importlib

    out: dict[str, type[RunfleetError]] = {}
    for code, owner in _CODES.items():
        module, _, qualname = owner.rpartition(".")
        if module.split(".")[0] == "tests" or "<locals>" in owner:
            continue
        cls = getattr(importlib.import_module(module), qualname, None)
        if isinstance(cls, type) and issubclass(cls, RunfleetError):
            out[code] = cls
    return out


def refusal_codes() -> dict[str, type[Refusal]]:
    return {code: cls for code, cls in error_classes().items() if issubclass(cls, Refusal)}


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


def test_every_4xx_the_api_answers_is_a_refusal_or_usage_error_the_cli_exits_3_or_2_for() -> None:
    """One classification (`runner.operations.errors`) for both surfaces: an error the API
    gives back to the caller as theirs to fix (4xx) is one the CLI exits 3 (refused) or 2
    (usage) for — no code is the caller's over HTTP and an internal error in the terminal.
    The staged-upload errors are refusals of the operations: 404 and 400, exit 3."""
    for code, cls in error_classes().items():
        exc = cls.__new__(cls)  # the classification reads the class, not the message
        if 400 <= status_for(exc) < 500:
            assert exit_code_for(exc) in (EXIT_REFUSED, EXIT_USAGE), code
    for cls, status in ((StagedUploadNotFound, 404), (StagedUploadInvalid, 400)):
        exc = cls("x")
        assert isinstance(exc, Refusal)
        assert (status_for(exc), exit_code_for(exc)) == (status, EXIT_REFUSED)


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
