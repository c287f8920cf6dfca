"""The runner's pod (SPEC §5.8, §11): a termination grace period that covers the drain, probes
and metrics on the named port the runner listens on, and — for every workload — a non-root pod
with a read-only root filesystem. The numbers come from the settings classes under each
overlay's settings, never copied."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from engine.config import EngineSettings
from runner.config import RunnerSettings
from tests.deploy.manifests import (
    METRICS_PORT_NAME,
    OVERLAYS,
    WORKLOADS,
    Manifest,
    final_stage,
    one,
    only_container,
    pod_spec,
    runner_deployment,
    runner_env,
    workload,
    workload_env,
)


def seconds(value: timedelta) -> float:
    return value.total_seconds()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_period_covers_the_unwind_ceiling_plus_30s(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    """SPEC §5.8: grace ≥ ceiling + 30 s, the ceiling derived from the budgets the runner reads
    (EngineSettings defaults plus whatever the overlay sets). No preStop hook: the kubelet
    counts the grace from before it, and a runner sleeping there would go on fetching new work
    it must then hand off; SIGTERM is where the drain starts."""
    manifests = rendered[overlay]
    settings_env(runner_env(manifests))
    ceiling = seconds(EngineSettings().unwind_ceiling)
    spec = pod_spec(runner_deployment(manifests))
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= ceiling + 30
    assert "preStop" not in only_container(runner_deployment(manifests)).get("lifecycle", {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runner_probes_use_healthz_and_readyz_on_the_metrics_port(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    manifests = rendered[overlay]
    container = only_container(runner_deployment(manifests))
    settings_env(runner_env(manifests))
    http_port = RunnerSettings().http_port
    ports = {p["name"]: p for p in container["ports"]}
    assert ports[METRICS_PORT_NAME]["containerPort"] == http_port != 0
    probes = {
        "livenessProbe": "/healthz",
        "startupProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    for probe, path in probes.items():
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, METRICS_PORT_NAME), probe
    monitor = one(manifests, "PodMonitor")
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["path"]) for e in endpoints] == [(METRICS_PORT_NAME, "/metrics")]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector == runner_deployment(manifests)["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("which", list(WORKLOADS))
def test_runner_pod_is_non_root_with_read_only_root_fs(
    rendered: dict[str, list[Manifest]], overlay: str, which: str
) -> None:
    manifests = rendered[overlay]
    obj = workload(manifests, which)
    spec = pod_spec(obj)
    container = only_container(obj)
    pod_sc = spec["securityContext"]
    sc = container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] > 0
    assert pod_sc["seccompProfile"] == sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not sc.get("privileged")
    # The image's own user is the same non-root uid.
    user = [args for word, args in final_stage() if word == "USER"][-1]
    assert user.split(":")[0] == str(pod_sc["runAsUser"])
    # The writable places are emptyDirs: /tmp always, RUNFLEET_DATA for the runner and the API.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert "emptyDir" in mounts["/tmp"]
    if obj["kind"] == "Deployment":
        assert "emptyDir" in mounts[workload_env(manifests, which)["RUNFLEET_DATA"]]
        assert container["resources"]["requests"] and container["resources"]["limits"]
        # Every writable volume is bounded (the others are read-only Secret mounts).
        assert all(v["emptyDir"].get("sizeLimit") for v in volumes.values() if "emptyDir" in v)
        assert all("secret" in v for v in volumes.values() if "emptyDir" not in v)
    assert container["resources"]["limits"]["memory"]
