"""The JetStream streams and the NATS cluster they live on (SPEC §11): the stream replicas each
overlay sets fit the NATS servers of its Helm values (three in production), and the Job that
creates the streams runs `runfleet streams ensure` from the runners' image and ConfigMap."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from publisher.config import WireSettings
from tests.deploy.manifests import (
    OVERLAYS,
    Manifest,
    config_map_of,
    container_argv,
    nats_values,
    only_container,
    pod_spec,
    runfleet_command,
    runner_deployment,
    runner_env,
    streams_job,
)


def test_production_overlay_has_three_stream_replicas(
    rendered: dict[str, list[Manifest]], settings_env: Callable[[dict[str, str]], None]
) -> None:
    manifests = rendered["production"]
    settings_env(runner_env(manifests))
    assert WireSettings().stream_replicas == 3
    # The Job that creates the streams reads the same ConfigMap as the runners.
    job_cm = config_map_of(manifests, only_container(streams_job(manifests)))
    runner_cm = config_map_of(manifests, only_container(runner_deployment(manifests)))
    assert job_cm["metadata"]["name"] == runner_cm["metadata"]["name"]
    assert runner_cm["data"]["RUNFLEET_STREAM_REPLICAS"] == "3"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stream_replicas_fit_the_nats_cluster_of_the_overlay(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    settings_env(runner_env(rendered[overlay]))
    values = nats_values(overlay)
    cluster = values["config"]["cluster"]
    servers = cluster["replicas"] if cluster["enabled"] else 1
    assert WireSettings().stream_replicas <= servers
    jetstream = values["config"]["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["fileStore"]["enabled"] is True
    assert jetstream["fileStore"]["pvc"]["enabled"] is True
    if overlay == "production":
        assert cluster["enabled"] is True and cluster["replicas"] == 3


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_streams_job_runs_streams_ensure(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    manifests = rendered[overlay]
    job = streams_job(manifests)
    container = only_container(job)
    command, path, _ = runfleet_command(container_argv(container))
    assert path == ["streams", "ensure"]
    assert command.name == "ensure"
    assert job["spec"]["backoffLimit"] > 0
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert pod_spec(job)["restartPolicy"] in {"Never", "OnFailure"}
    runner = only_container(runner_deployment(manifests))
    assert container["image"] == runner["image"]
    # ... and the runners run `runfleet runner` from the same image.
    _, runner_path, _ = runfleet_command(container_argv(runner))
    assert runner_path == ["runner"]
