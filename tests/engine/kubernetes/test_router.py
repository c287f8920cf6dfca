"""The workflow's `sandbox.driver` wins over `RUNFLEET_SANDBOX` (SPEC §6.1, §7.1 v2.2), and the
kubernetes driver opened through the registry reads its settings and `KUBECONFIG` at start."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.sandbox import LocalSandbox, SandboxSpec, open_driver
from engine.sandbox.errors import SandboxError
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.sandbox import KubernetesSandbox
from engine.sandbox.kubernetes.settings import KubernetesSettingsInvalid
from engine.sandbox.registry import DriverContext
from engine.sandbox.router import DriverRouter
from tests.engine.kubernetes.cluster import NAMESPACE, Cluster, fake_cluster


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with fake_cluster(tmp_path / "pods") as c:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: k, cluster: {{server: '{c.url}'}}}}]\n"
            "users: [{name: u, user: {}}]\n"
            "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("RUNFLEET_SANDBOX_NAMESPACE", NAMESPACE)
        monkeypatch.delenv("RUNFLEET_SANDBOX_IMAGE", raising=False)
        yield c


def _spec(tmp_path: Path, token: str, **kw: Any) -> SandboxSpec:
    return SandboxSpec(
        run_id="run-1",
        lease_token=token,
        workspace_dir=tmp_path / "ws" / token,
        scratch_dir=tmp_path / "scratch",
        **kw,
    )


async def test_workflow_sandbox_driver_wins_over_RUNFLEET_SANDBOX(
    cluster: Cluster, tmp_path: Path
) -> None:
    router = DriverRouter("local", DriverContext(data_dir=tmp_path / "data"))
    on_pod = await router.start(_spec(tmp_path, "a", driver="kubernetes", image="busybox:1.36"))
    local = await router.start(_spec(tmp_path, "b"))
    try:
        assert isinstance(on_pod, KubernetesSandbox) and isinstance(local, LocalSandbox)
        assert list(cluster.pods()) == [on_pod.name]
        assert (await on_pod.exec("echo pod", timeout_s=10)).stdout_tail == b"pod\n"
        tokens = sorted(r.token for r in await router.list_sandboxes())
        assert tokens == ["a", "b"]  # every driver opened so far
        assert sorted(await router.stop_others("run-1", keep_token="none")) == sorted(
            [on_pod.name, local.name]
        )
        assert cluster.pods() == {}
    finally:
        await on_pod.stop()
        await local.stop()
        await router.close()


async def test_kubernetes_as_the_default_driver_refuses_to_start_without_an_image(
    cluster: Cluster, tmp_path: Path
) -> None:
    with pytest.raises(KubernetesSettingsInvalid, match="RUNFLEET_SANDBOX_IMAGE"):
        open_driver("kubernetes", DriverContext(data_dir=tmp_path))


async def test_kubernetes_driver_is_found_by_name_in_the_registry(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNFLEET_SANDBOX_IMAGE", "busybox:1.36")
    monkeypatch.setenv("RUNFLEET_SANDBOX_READY_BUDGET", "45s")
    driver = open_driver("kubernetes", DriverContext(data_dir=tmp_path))
    assert isinstance(driver, KubernetesSandboxDriver)
    assert driver.settings.budgets.ready_s == 45.0 and driver.settings.namespace == NAMESPACE
    sandbox = await driver.start(_spec(tmp_path, "c"))
    assert list(cluster.pods()) == [sandbox.name]
    await sandbox.stop()
    await driver.close()


async def test_a_driver_only_a_workflow_named_that_cannot_work_here_fails_only_its_own_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workflow walkthrough: one run naming `kubernetes` on a runner with no cluster left
    that driver opened in the router, and every later claim's `stop_others` (compute-only runs
    included) failed on it. The named driver's own start still fails that run."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    router = DriverRouter("local", DriverContext(data_dir=tmp_path / "data"))
    try:
        with pytest.raises(SandboxError, match="no kubernetes API"):
            await router.start(_spec(tmp_path, "a", driver="kubernetes", image="busybox:1.36"))
        local = await router.start(_spec(tmp_path, "b"))
        assert await router.stop_others("run-1", keep_token="b") == []  # no error from k8s
        assert [r.token for r in await router.list_sandboxes()] == ["b"]
        await local.stop()
    finally:
        await router.close()
