"""The kubernetes driver against a real cluster: runs only when `KUBECONFIG` is set (marker
`k8s_real`; docs/kubernetes.md has the command). Never run here: there is no cluster in this
environment, so these tests are written against the client's contract and unexercised."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.local import new_run_id
from engine.sandbox import SandboxImageInvalid, SandboxLost, SandboxSpec
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesSettings

pytestmark = [
    pytest.mark.k8s_real,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG (a cluster)"),
]


@pytest.fixture
async def driver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubernetesSandboxDriver]:
    monkeypatch.setenv(
        "RUNFLEET_SANDBOX_IMAGE", os.environ.get("RUNFLEET_SANDBOX_IMAGE", "busybox:1.36")
    )
    d = KubernetesSandboxDriver(KubernetesSettings.from_env(require_image=True))
    yield d
    await d.close()


def _spec(tmp_path: Path, **kw: Any) -> SandboxSpec:
    return SandboxSpec(
        run_id=new_run_id(),
        lease_token="t1",
        workspace_dir=tmp_path / "ws",
        scratch_dir=tmp_path / "scratch",
        **kw,
    )


async def test_real_cluster_start_exec_copy_stop(
    driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    sandbox = await driver.start(_spec(tmp_path))
    try:
        result = await sandbox.exec("echo hi; id -u; exit 4", timeout_s=60)
        assert result.exit_code == 4 and result.stdout_tail.startswith(b"hi\n")
        assert result.stdout_tail.split()[1] != b"0"  # non-root
        await sandbox.exec("mkdir -p d && echo x > d/f", timeout_s=60)
        await sandbox.copy_out(Path("d"), tmp_path / "d.tar")
        assert (tmp_path / "d.tar").stat().st_size > 0
    finally:
        await sandbox.stop()
    assert sandbox.name not in {r.name for r in await driver.list_sandboxes()}


async def test_real_cluster_image_pull_error_is_image_invalid(
    driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    with pytest.raises(SandboxImageInvalid):
        await driver.start(_spec(tmp_path, image="runfleet.invalid/no-such-image:0"))


async def test_real_cluster_deleted_pod_fails_the_exec_sandbox_lost(
    driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    sandbox = await driver.start(_spec(tmp_path))
    started = asyncio.Event()

    async def on_output(stream: str, chunk: bytes) -> None:
        started.set()

    running = asyncio.create_task(
        sandbox.exec("echo go; sleep 300", timeout_s=600, on_output=on_output)
    )
    await asyncio.wait_for(started.wait(), 60)
    api = await driver.api()
    await api.delete_namespaced_pod(sandbox.name, driver.settings.namespace, grace_period_seconds=0)
    with pytest.raises(SandboxLost):
        await asyncio.wait_for(running, 30)
    await sandbox.stop()
