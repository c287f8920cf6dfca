"""A runner with the kubernetes driver, against the fake API server (kmock) and the exec test
server (issue 13, done-when): a workflow with a tool node runs to `finished` in a pod; a pod
deleted mid-node gives `sandbox_lost`, the node fails `SANDBOX_LOST`, the delivery is nakked
with its delay, and a new execution on a new pod finishes (SPEC §7.1, §7.2, §6.6)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.sandbox.registry import DriverContext
from engine.sandbox.router import DriverRouter
from runner.config import RunnerSettings
from runner.runner import Runner
from tests.engine.kubernetes.cluster import NAMESPACE, Cluster, fake_cluster
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import runner_process, spawn_runner
from tests.runner.test_delivery_rules import deliveries


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
        monkeypatch.setenv("RUNFLEET_SANDBOX_IMAGE", "busybox:1.36")
        yield c


@pytest.fixture
async def k8s_runner(fleet: Fleet, cluster: Cluster) -> AsyncIterator[Runner]:
    """`RUNFLEET_SANDBOX=kubernetes`: the driver the runner opens at start, as `runfleet
    runner` does (`Env.driver()`)."""
    router = DriverRouter("kubernetes", DriverContext(data_dir=fleet.tmp / "data"))
    runner = Runner(
        store=fleet.store,
        driver=router,
        data_dir=fleet.tmp / "data",
        blobs=fleet.blobs,
        settings=RunnerSettings(
            slots=2, http_host="127.0.0.1", transient_delay="0.2s", lagging_delay="0.2s"
        ),
        engine=fleet.engine,
        wire=fleet.wire,
        owner="k8s-runner",
    )
    await runner.start()
    fleet.runners.append(runner)
    yield runner
    await runner.shutdown()  # closes the driver's API client too


def _workflow(mark: Path) -> str:
    # The first execution marks the host file and blocks; the next one finds the mark.
    return f"""
name: on-pods
entry: work
nodes:
  work:
    kind: tool
    timeout: 120
    run: |
      if [ -f {mark} ]; then echo second; else touch {mark}; echo first; sleep 60; fi
"""


async def test_a_tool_node_runs_in_a_pod_to_finished(
    fleet: Fleet, cluster: Cluster, k8s_runner: Runner, tmp_path: Path
) -> None:
    mark = tmp_path / "mark"
    mark.touch()  # no blocking: straight to "second"
    run = await fleet.launch(_workflow(mark))
    done = await fleet.wait_status(run.run_id, "finished", within=30)
    assert done.checkpoint is not None
    assert "second" in str(done.checkpoint.outputs["work"])
    events = await fleet.store.read_events(run.run_id)
    started = [e.data["name"] for e in events if e.type == "sandbox_started"]
    assert len(started) == 1 and started[0].startswith("rf-")
    assert cluster.pods() == {}  # torn down with the execution


async def test_a_pod_deleted_mid_node_is_sandbox_lost_nakked_and_a_new_pod_finishes(
    fleet: Fleet, cluster: Cluster, k8s_runner: Runner, tmp_path: Path
) -> None:
    mark = tmp_path / "mark"
    run = await fleet.launch(_workflow(mark))

    async def first_pod() -> str | None:
        pods = list(cluster.pods())
        return pods[0] if mark.exists() and len(pods) == 1 else None

    pod = await eventually(first_pod, within=30)
    await cluster.delete(pod)  # kubectl delete pod: the object goes, the node kills it
    done = await fleet.wait_status(run.run_id, "finished", within=60)
    assert done.checkpoint is not None and "second" in str(done.checkpoint.outputs["work"])
    events = await fleet.store.read_events(run.run_id)
    types = [e.type for e in events]
    lost = [e for e in events if e.type == "sandbox_lost"]
    assert len(lost) == 1 and lost[0].data["reason"] == "deleted"
    assert any(e.type == "node_failed" and e.data.get("code") == "SANDBOX_LOST" for e in events), (
        types
    )
    assert deliveries(k8s_runner, "nak", "transient") >= 1  # with the code's delay
    pods = [e.data["name"] for e in events if e.type == "sandbox_started"]
    assert len(pods) == 2 and pods[0] == pod and pods[1] != pod  # a new execution, a new pod
    assert types.count("run_claimed") == 2


async def test_runfleet_runner_process_with_the_kubernetes_driver_serves_a_run(
    fleet: Fleet, cluster: Cluster, tmp_path: Path
) -> None:
    """`RUNFLEET_SANDBOX=kubernetes runfleet runner` starts and serves runs (issue 13,
    done-when): the process reads KUBECONFIG and RUNFLEET_SANDBOX_* from the environment."""
    mark = tmp_path / "mark"
    mark.touch()
    async with runner_process(fleet, "k8s-runner", env={"RUNFLEET_SANDBOX": "kubernetes"}):
        run = await fleet.launch(_workflow(mark))
        done = await fleet.wait_status(run.run_id, "finished", within=60)
    assert done.checkpoint is not None and "second" in str(done.checkpoint.outputs["work"])
    events = await fleet.store.read_events(run.run_id)
    assert next(e.data["name"] for e in events if e.type == "sandbox_started").startswith("rf-")


async def test_runfleet_runner_with_the_kubernetes_driver_and_no_image_refuses_to_start(
    fleet: Fleet, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUNFLEET_SANDBOX_IMAGE")
    runner = spawn_runner(fleet, fleet.tmp / "no-image.log", env={"RUNFLEET_SANDBOX": "kubernetes"})
    try:

        async def exited() -> int | None:
            return runner.returncode

        code = await eventually(exited, within=30)
        assert code != 0
        assert "RUNFLEET_SANDBOX_IMAGE" in runner.log()
    finally:
        runner.kill()
