"""A create the API server refuses because of the runner, not the pod (its credentials, its
RBAC, a sandbox namespace that does not exist), is `SandboxAccessDenied`: transient (the run
reads `INTERNAL_ERROR` and waits for the operator's fix), never the terminal
`SANDBOX_START_FAILED` that would fail every run for good. Served by a local aiohttp API server
answering the pod create with the status and message a real API server sends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web
from kubernetes.aio.client import ApiClient, Configuration

from engine.failures import FailureCode, is_auto_resumable
from engine.sandbox import SandboxSpec, SandboxStartFailed
from engine.sandbox.errors import SandboxAccessDenied
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.protocols import SetupBudgets

pytestmark = pytest.mark.asyncio

RBAC = (
    'pods is forbidden: User "system:serviceaccount:runfleet:runfleet-runner" cannot create '
    'resource "pods" in API group "" in the namespace "runfleet-sandboxes"'
)
NO_NAMESPACE = 'namespaces "runfleet-sandboxes" not found'
POD_SECURITY = 'pods "rf-x" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot'


@asynccontextmanager
async def refusing_api_server(status: int, message: str) -> AsyncIterator[list[str]]:
    """An API server whose every pod create is refused with `status` and `message` (a
    `v1.Status` body, as kube-apiserver sends); yields the paths it was asked for."""
    asked: list[str] = []

    async def create(request: web.Request) -> web.Response:
        asked.append(request.path)
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/{ns}/pods", create)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    asked.append(f"http://127.0.0.1:{port}")
    try:
        yield asked
    finally:
        await runner.cleanup()


async def start_against(url: str, tmp_path: Path) -> None:
    async def api_factory() -> ApiClient:
        return ApiClient(Configuration(host=url))

    settings = KubernetesSettings(
        namespace="runfleet-sandboxes",
        image="busybox:1.36",
        budgets=SetupBudgets(schedule_s=2, ready_s=2, seed_s=2),
    )
    driver = KubernetesSandboxDriver(settings, api_factory=api_factory, poll_s=0.02)
    try:
        await driver.start(
            SandboxSpec(
                run_id="run-1",
                lease_token="tok1",
                workspace_dir=tmp_path / "ws",
                scratch_dir=tmp_path / "scratch",
            )
        )
    finally:
        await driver.close()


@pytest.mark.parametrize(
    ("status", "message"),
    [(403, RBAC), (404, NO_NAMESPACE), (401, "Unauthorized")],
    ids=["rbac", "no-namespace", "unauthorized"],
)
async def test_a_create_refused_for_the_runners_access_is_transient_not_start_failed(
    status: int, message: str, tmp_path: Path
) -> None:
    async with refusing_api_server(status, message) as asked:
        with pytest.raises(SandboxAccessDenied) as raised:
            await start_against(asked[0], tmp_path)
    assert asked[1:] == ["/api/v1/namespaces/runfleet-sandboxes/pods"]  # asked once, not retried
    err = raised.value
    assert not isinstance(err, SandboxStartFailed)
    assert err.failure_code is None  # an execution reads INTERNAL_ERROR: transient (§6.6)
    assert is_auto_resumable(FailureCode.INTERNAL_ERROR)  # the run waits for the fix
    assert str(status) in str(err) and "runfleet-sandboxes" in str(err)
    assert err.remedy is not None and "RBAC" in err.remedy


async def test_a_create_refused_by_pod_security_is_still_start_failed(tmp_path: Path) -> None:
    async with refusing_api_server(403, POD_SECURITY) as asked:
        with pytest.raises(SandboxStartFailed, match="violates PodSecurity"):
            await start_against(asked[0], tmp_path)
