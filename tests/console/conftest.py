"""Fixtures for the HTTP API tests: the API app over a real fleet — the session's nats-server,
uuid-namespaced streams, a real SQLite store, an in-process runner when a test starts one —
served by aiohttp's test server on a real socket, with three tokens: tenant `default`'s
operate and read tokens and tenant `b`'s operate token.

Every JSON response a test reads through `Api.call` is validated against the schema
`/openapi.json` gives for its path, method and status: a route that answers outside its
document fails whichever test touched it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from runner.console import Principal, TokenBook, create_app
from runner.console.api import ROUTES
from runner.console.openapi import document
from runner.operations import Env
from store.config import StoreSettings
from tests.runner import conftest as runner_fixtures
from tests.runner.conftest import Fleet

fleet = runner_fixtures.fleet

OP_A, READ_A, OP_B = "token-operate-a", "token-read-a", "token-operate-b"
TOKENS = TokenBook.of(
    {
        OP_A: Principal("default", "operate"),
        READ_A: Principal("default", "read"),
        OP_B: Principal("b", "operate"),
    }
)
DOC = document(ROUTES)


def fleet_env(fleet: Fleet) -> Env:
    settings = StoreSettings(data=fleet.tmp / "data", tenant="default")
    return Env(settings, fleet.engine, fleet.store, fleet.blobs, "runfleet-api-test", fleet.wire)


def response_schema(path: str, method: str, status: int) -> dict[str, Any] | None:
    """The JSON schema `DOC` gives a response, resolvable against the whole document."""
    op = DOC["paths"][path][method.lower()]
    answer = op["responses"].get(str(status))
    assert answer is not None, f"{method} {path} answered {status}, which it does not document"
    content = answer.get("content", {}).get("application/json")
    if content is None:
        return None
    return {**content["schema"], "components": DOC["components"]}


def validate(path: str, method: str, status: int, body: Any) -> None:
    schema = response_schema(path, method, status)
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(body)


@dataclass
class Api:
    client: TestClient[Any, Any]
    env: Env
    fleet: Fleet

    @property
    def url(self) -> str:
        return str(self.client.make_url(""))

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = OP_A,
        template: str | None = None,
        **kwargs: Any,
    ) -> tuple[int, Any, ClientResponse]:
        """Call the API; validate a JSON answer against the document (`template`: the
        documented path when `path` has its parameters filled in)."""
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        resp = await self.client.request(method, path, headers=headers, **kwargs)
        body = await resp.json() if resp.content_type == "application/json" else await resp.text()
        documented = DOC["paths"].get(template or path, {})
        if method.lower() in documented:
            validate(template or path, method, resp.status, body)
        return resp.status, body, resp


@pytest.fixture
async def api(fleet: Fleet) -> AsyncIterator[Api]:
    env = fleet_env(fleet)
    async with TestClient(TestServer(create_app(env, TOKENS))) as client:
        yield Api(client, env, fleet)
