"""The sweeper reaps sandbox pods whose run's lease is no longer theirs (SPEC §5.9, issue 13
item 5), across runner restarts: the kubernetes driver finds them by label on the API server
(kmock here), so a fresh driver — a runner that never started them — reaps them as well."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine.local import new_run_id
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.protocols import SandboxSpec, SetupBudgets
from runner.sweeper import Sweeper
from store import RunStatus, utcnow
from tests.engine.kubernetes.cluster import NAMESPACE, Cluster, fake_cluster
from tests.runner.callables import bound_drain, idle_runner, lease, new_run
from tests.runner.conftest import Fleet


@pytest.fixture(autouse=True)
async def _quick_drain(fleet: Fleet) -> AsyncIterator[None]:
    yield
    bound_drain(fleet.runners)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with fake_cluster(tmp_path / "pods") as c:
        yield c


def _driver(cluster: Cluster) -> KubernetesSandboxDriver:
    settings = KubernetesSettings(
        namespace=NAMESPACE,
        image="busybox:1.36",
        budgets=SetupBudgets(schedule_s=5, ready_s=5, seed_s=5),
        delete_grace_s=0,
        gone_timeout_s=5,
    )
    return KubernetesSandboxDriver(settings, api_factory=cluster.api_factory, poll_s=0.02)


async def test_sweeper_reaps_sandbox_pods_whose_run_lease_is_no_longer_theirs_across_restarts(
    fleet: Fleet, cluster: Cluster, tmp_path: Path
) -> None:
    doc = new_run(
        "hello",
        run_id=new_run_id(),
        status=RunStatus.RUNNING,
        lease=lease(2, ttl=120),
        attempt=2,
        attempt_at=utcnow(),
    )
    await fleet.store.create_run(doc)
    run = await fleet.store.get_run(doc.run_id)
    assert run.lease is not None

    def spec(run_id: str, token: str) -> SandboxSpec:
        return SandboxSpec(
            run_id=run_id,
            lease_token=token,
            workspace_dir=tmp_path / "ws",
            scratch_dir=tmp_path / "scratch",
        )

    before_restart = _driver(cluster)  # the runner that started them, gone since
    live = await before_restart.start(spec(run.run_id, run.lease.token))
    stale = await before_restart.start(spec(run.run_id, "earlier-execution"))
    unknown = await before_restart.start(spec(new_run_id(), "of-a-deleted-run"))
    for box in (live, stale, unknown):
        box.watch.stop()  # that runner is gone: nobody watches them any more
    await before_restart.close()

    after_restart = _driver(cluster)
    runner = await idle_runner(fleet, owner="sweeper-k8s")
    sweeper = Sweeper(replace(runner.svc, driver=after_restart))
    try:
        report = await sweeper.sweep_once(force=True)
        assert report.actions["sandbox_reaped"] == 2
        assert set(cluster.pods()) == {live.name}
        refs = await after_restart.list_sandboxes()
        assert [(r.run_id, r.token) for r in refs] == [(run.run_id, run.lease.token)]
    finally:
        await after_restart.close()
