"""How failures read over the HTTP API (SPEC v2.2 §10c): typed refusals as 4xx with the CLI's
error body and codes, unreachable infrastructure as 503 with `Retry-After`, one table."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import runner.console  # noqa: F401 - imports every operation, so every refusal is registered
from runner.cli.errors import EXIT_REFUSED, EXIT_USAGE, exit_code_for
from runner.console import create_app, server
from runner.console.errors import REFUSAL_STATUS, RETRY_AFTER_S, status_for
from runner.operations import Env
from store import Refusal, RunQuery, RunStatus
from store.errors import _CODES, RunfleetError
from store.staging import StagedUploadInvalid, StagedUploadNotFound
from store.url import open_store
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
        elif code.startswith("answers_") or code == "idempotency_key_reused":
            assert status == 422, code
        elif code.endswith("_too_large") and code != "attachment_too_large":
            assert status == 413, code  # a request larger than the queue can carry
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
    # and so does a cancel, which is a CAS (SPEC §4; the control signal is best effort): it
    # answered 503 (an operator walkthrough)
    resp = await api_without_nats.post(f"/api/v1/runs/{paused.run_id}/cancel", headers=auth)
    assert resp.status == 200, await resp.text()
    assert (await fleet.store.get_run(paused.run_id)).status is RunStatus.CANCELLED


async def test_readyz_is_ready_when_nats_and_the_store_answer_and_needs_no_token(
    api: Api,
) -> None:
    status, body, _ = await api.call("GET", "/readyz", token=None)
    assert (status, body) == (200, {"ok": True, "problems": []})


async def test_readyz_is_503_naming_nats_when_nats_is_unreachable_while_healthz_stays_ok(
    api_without_nats: TestClient[web.Request, web.Application],
) -> None:
    """`/healthz` is liveness (restarting the server would not bring NATS back); `/readyz`
    takes it out of a Service's endpoints. Codes only: it answers without a token."""
    resp = await api_without_nats.get("/readyz")
    body = await resp.json()
    assert resp.status == 503, body
    assert body == {"ok": False, "problems": ["nats: nats_unavailable"]}
    validate("/readyz", "GET", 503, body)
    assert (await api_without_nats.get("/healthz")).status == 200


async def test_readyz_answers_within_its_bound_when_nats_accepts_and_says_nothing(
    fleet: Fleet,
) -> None:
    """A hung server (it accepts, then never speaks): the client's own connect budget took
    ≈ 9 s, past a probe's timeout (an operator walkthrough, SIGSTOPped nats-server)."""
    silent: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent.append(writer)  # held open, never answered

    hung = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = hung.sockets[0].getsockname()[1]
    env = fleet_env(fleet)
    wire = fleet.wire.model_copy(update={"nats_url": f"nats://127.0.0.1:{port}"})
    down = Env(env.settings, env.engine_settings, env.store, env.blobs, env.client, wire)
    try:
        async with TestClient(TestServer(create_app(down, TOKENS))) as client:
            resp = await client.get("/readyz", timeout=aiohttp.ClientTimeout(total=8))
            body = await resp.json()
    finally:
        for writer in silent:
            writer.close()
        hung.close()
        await hung.wait_closed()
    assert resp.status == 503 and body["problems"] == ["nats: nats_timeout"], body
    # the question left behind ends by itself once the server is gone, closing what it opened
    if server._ASKING:
        await asyncio.wait(set(server._ASKING), timeout=30)
        await asyncio.sleep(0)  # its done-callback, which forgets it, runs on the next turn
    assert not server._ASKING


async def test_readyz_names_a_store_that_does_not_answer(fleet: Fleet) -> None:
    env = fleet_env(fleet)
    closed = await open_store(f"sqlite:///{fleet.tmp / 'elsewhere.db'}")
    await closed.close()
    app = create_app(dataclasses.replace(env, store=closed), TOKENS)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/readyz")
        body = await resp.json()
    assert resp.status == 503, body
    assert body["problems"] and all(p.startswith("store: ") for p in body["problems"]), body


async def test_unknown_routes_and_methods_answer_the_error_shape_with_a_remedy(api: Api) -> None:
    """docs/api.md: an error body always carries code, message and remedy."""
    status, body, _ = await api.call("GET", "/api/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    assert "openapi" in body["error"]["remedy"]
    status, body, _ = await api.call("DELETE", "/api/v1/runs")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert "method" in body["error"]["remedy"]
    status, body, _ = await api.call(
        "POST", "/api/v1/runs", data=b"not json", headers={"Content-Type": "application/json"}
    )
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert body["error"]["remedy"]
    status, body, _ = await api.call("GET", "/api/v1/dlq/abc", template="/api/v1/dlq/{record_id}")
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert body["error"]["remedy"]
    status, body, _ = await api.call("GET", "/api/v1/runs?limit=0", template="/api/v1/runs")
    assert status == 400 and set(body["error"]) >= {"code", "message", "remedy"}, body


async def raw_http(api: Api, request: bytes) -> bytes:
    """Send `request` as bytes on a socket (a client library would refuse or re-encode what a
    test needs to send) and return the start of the answer."""
    reader, writer = await asyncio.open_connection(api.client.server.host, api.client.server.port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read(4096)
    finally:
        writer.close()


async def test_a_duration_too_large_to_represent_is_a_typed_400(api: Api) -> None:
    """`since` and `older_than` past 100 years (`1e300` seconds, `999999d`) would overflow
    `now - duration`: refused as the malformed duration they are, never a 500."""
    for path, template in (
        ("/api/v1/runs?since=1e300", "/api/v1/runs"),
        ("/api/v1/runs?since=999999d", "/api/v1/runs"),
        ("/api/v1/dlq?older_than=1e300", "/api/v1/dlq"),
    ):
        status, body, _ = await api.call("GET", path, template=template)
        assert status == 400 and body["error"]["code"] == "invalid_request", (path, body)
        assert "at most 100 years" in body["error"]["message"]
    status, body, _ = await api.call(
        "POST", "/api/v1/dlq/purge", json={"all": True, "older_than": "1e300"}
    )
    assert status == 400 and body["error"]["code"] == "invalid_request", body


async def test_a_bearer_token_that_is_not_utf8_is_a_plain_401(api: Api) -> None:
    answer = await raw_http(
        api,
        b"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]
    assert b'"unauthorized"' in answer


async def test_a_405_names_the_methods_the_resource_has_in_allow(api: Api) -> None:
    """RFC 9110 §15.5.6: a 405 carries `Allow` (found by an API walkthrough: it had none)."""
    status, body, resp = await api.call("DELETE", "/api/v1/runs")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert set(resp.headers["Allow"].split(", ")) == {"GET", "POST"}


async def test_a_body_not_sent_as_json_is_415_and_nothing_is_launched(api: Api) -> None:
    """`text/plain`, a form (curl's `-d` without `-H`) or bytes were parsed as JSON anyway:
    now 415 with the header to send; a body without `Content-Type` is still read as JSON."""
    payload = b'{"workflow": ' + json.dumps(HELLO).encode() + b"}"
    for kind in ("text/plain", "application/x-www-form-urlencoded", "application/octet-stream"):
        status, body, _ = await api.call(
            "POST", "/api/v1/runs", data=payload, headers={"Content-Type": kind}
        )
        assert status == 415, (kind, body)
        assert body["error"]["code"] == "unsupported_media_type"
        assert "application/json" in body["error"]["remedy"]
    assert (await api.fleet.store.list_runs(RunQuery(tenant="default"))).runs == []
    for kind in ("application/json; charset=utf-8", "application/merge-patch+json"):
        status, body, _ = await api.call(
            "POST", "/api/v1/runs", data=payload, headers={"Content-Type": kind}
        )
        assert status == 201, (kind, body)


async def test_an_unknown_query_parameter_is_refused_not_ignored(api: Api) -> None:
    """`?stauts=failed` listed every run as if it were the answer (an API walkthrough)."""
    status, body, _ = await api.call("GET", "/api/v1/runs?stauts=failed", template="/api/v1/runs")
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert "'stauts'" in body["error"]["message"]
    assert "status" in body["error"]["remedy"]
    status, body, _ = await api.call("GET", "/api/v1/runs?status=failed", template="/api/v1/runs")
    assert status == 200, body


async def test_a_body_nested_too_deeply_is_the_typed_400_for_malformed_json(api: Api) -> None:
    """200 000 `[`: past the JSON parser's stack (`RecursionError`), which is the body not
    reading as JSON like any other."""
    depth = 200_000
    body = b'{"workflow": ' + b"[" * depth + b"]" * depth + b"}"
    status, answer, _ = await api.call(
        "POST", "/api/v1/runs", data=body, headers={"Content-Type": "application/json"}
    )
    assert status == 400 and answer["error"]["code"] == "invalid_request", answer


async def test_a_last_event_id_that_is_not_ascii_digits_reads_as_absent(api: Api) -> None:
    """`'²'.isdigit()` is true and `int('²')` fails: only ASCII digits (no longer than the
    largest seq) are a `Last-Event-ID`; anything else is ignored, as other malformed ids are."""
    run = await put_run(api.fleet.store, status=RunStatus.FINISHED)
    path = f"/api/v1/runs/{run.run_id}/events/stream"
    for last_id in ("²".encode().decode("latin-1"), "9" * 5000, "-1", "x"):
        resp = await api.client.get(
            path, headers={"Authorization": f"Bearer {OP_A}", "Last-Event-ID": last_id}
        )
        text = await resp.text()
        assert resp.status == 200, (last_id[:10], text[:300])
        assert text.startswith("event: end"), text[:300]


def test_no_refusal_remedy_names_a_cli_flag_or_command_the_http_words_do_not_translate() -> None:
    """Every CLI phrase a refusal's remedy uses reaches an HTTP caller translated; a new remedy
    naming a flag or a `runfleet` command without an HTTP equivalent fails here."""
    import re

    from runner.console.errors import http_remedy

    cli_only = {"not_confirmed", "fleet_already_running"}  # never an API answer
    untranslated = {}
    for code, cls in refusal_codes().items():
        if code in cli_only:
            continue
        remedy = http_remedy(cls.remedy) if isinstance(cls.remedy, str) else None
        if remedy and re.search(
            r"(?<![\w-])--[a-z]|`runfleet (resume|status|events|cancel|rewind)", remedy
        ):
            untranslated[code] = remedy
    # The remedies built per case: a run refused for its status, a scratch that cannot follow.
    from engine.refusals import NEXT_STEP, ScratchNotPortable

    built = [*NEXT_STEP.values(), ScratchNotPortable("r", "why", also_needs_force=True).remedy]
    for remedy in built:
        shown = http_remedy(remedy) or ""
        if re.search(r"(?<![\w-])--[a-z]|`runfleet (resume|status|events|cancel|rewind)", shown):
            untranslated[remedy] = shown
    assert not untranslated, untranslated
