"""The kubernetes driver asks at the runner's start whether it may manage sandbox pods
(`engine/sandbox/kubernetes/access.py`): a `SelfSubjectAccessReview` per permission, answered
here by a local aiohttp API server the way kube-apiserver answers them (the review back, with
`status.allowed`). A denial names every missing permission; an unanswerable question is not a
denial."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from kubernetes.aio.client import ApiClient, Configuration

from engine.sandbox.errors import SandboxAccessDenied
from engine.sandbox.kubernetes.access import NEEDED
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.protocols import SetupBudgets

pytestmark = pytest.mark.asyncio

SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


@asynccontextmanager
async def authorizer(
    denied: set[tuple[str, str]], *, status: int = 201
) -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    """An API server answering each review: allowed unless (verb, resource[/sub]) is in
    `denied`; with another `status` than 201 every review is refused with it. Yields its URL
    and the resource attributes it was asked about."""
    asked: list[dict[str, object]] = []

    async def review(request: web.Request) -> web.Response:
        body = await request.json()
        attrs = body["spec"]["resourceAttributes"]
        asked.append(attrs)
        if status != 201:
            refusal = {"kind": "Status", "status": "Failure", "message": "forbidden"}
            return web.json_response(refusal, status=status)
        key = attrs["resource"] + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
        allowed = (attrs["verb"], key) not in denied
        body["status"] = {"allowed": allowed}
        if not allowed:
            body["status"]["reason"] = "no RBAC policy matched"
        return web.Response(status=201, text=json.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_post(SSAR, review)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", asked
    finally:
        await runner.cleanup()


def driver_for(url: str) -> KubernetesSandboxDriver:
    async def api_factory() -> ApiClient:
        return ApiClient(Configuration(host=url))

    settings = KubernetesSettings(
        namespace="runfleet-sandboxes", image="busybox:1.36", budgets=SetupBudgets()
    )
    return KubernetesSandboxDriver(settings, api_factory=api_factory)


async def test_preflight_asks_for_every_permission_the_driver_uses_in_its_namespace() -> None:
    async with authorizer(set()) as (url, asked):
        driver = driver_for(url)
        try:
            await driver.preflight()
        finally:
            await driver.close()
    assert {a["namespace"] for a in asked} == {"runfleet-sandboxes"}
    assert [(a["verb"], a["resource"], a.get("subresource") or "") for a in asked] == list(NEEDED)


async def test_preflight_a_runner_that_may_not_exec_or_delete_is_refused_naming_both() -> None:
    async with authorizer({("create", "pods/exec"), ("delete", "pods")}) as (url, _):
        driver = driver_for(url)
        try:
            with pytest.raises(SandboxAccessDenied) as raised:
                await driver.preflight()
        finally:
            await driver.close()
    message = raised.value.message
    assert "delete pods (no RBAC policy matched)" in message
    assert "create pods/exec" in message
    assert "'runfleet-sandboxes'" in message and "create pods," not in message
    assert raised.value.remedy is not None and "RBAC" in raised.value.remedy


@pytest.mark.parametrize("status", [403, 404, 500])
async def test_preflight_a_question_the_api_server_will_not_answer_is_no_denial(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    async with authorizer(set(), status=status) as (url, asked):
        driver = driver_for(url)
        try:
            with caplog.at_level(logging.WARNING):
                await driver.preflight()  # starts: a run's sandbox start will tell
        finally:
            await driver.close()
    assert len(asked) == 1
    assert "could not check the runner's access" in caplog.text


async def test_preflight_an_unreachable_api_server_is_no_denial(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = driver_for("http://127.0.0.1:9")  # nothing listens on the discard port
    try:
        with caplog.at_level(logging.WARNING):
            await driver.preflight()
    finally:
        await driver.close()
    assert "could not check the runner's access" in caplog.text
