"""KEDA scales the runners on their consumer's lag (SPEC §11): the ScaledObject targets the
runner Deployment, reads the stream and consumer `publisher.wire.WireNames` computes, one runner
per `RUNFLEET_SLOTS` of lag, from NATS' monitoring endpoint, never down to zero."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from publisher.config import WireSettings
from publisher.wire import WireNames
from runner.config import RunnerSettings
from tests.deploy.manifests import (
    OVERLAYS,
    Manifest,
    nats_values,
    one,
    runner_deployment,
    runner_env,
    trigger_auth_parameters,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scaledobject_scales_on_the_runners_consumer_lag(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    manifests = rendered[overlay]
    scaled = one(manifests, "ScaledObject")
    deployment = runner_deployment(manifests)
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert "replicas" not in deployment["spec"], "KEDA owns the replica count"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    meta = trigger["metadata"]
    settings_env(runner_env(manifests))
    names = WireNames(WireSettings().namespace)
    assert names == WireNames()
    assert (meta["stream"], meta["consumer"]) == (names.runs_stream, names.consumer)
    if "authenticationRef" in trigger:  # the account is read from a Secret (production)
        assert "account" not in meta
        assert trigger_auth_parameters(manifests, trigger) == {"account"}
    else:
        assert meta["account"] == "$G"
    # One runner takes RUNFLEET_SLOTS deliveries at once: one runner per that much lag.
    assert int(meta["lagThreshold"]) == RunnerSettings().slots
    # The endpoint is NATS' monitoring port, in the namespace the runners connect to.
    host, port = meta["natsServerMonitoringEndpoint"].rsplit(":", 1)
    values = nats_values(overlay)
    assert int(port) == values["config"]["monitor"]["port"]
    assert values["config"]["monitor"]["enabled"] is True
    nats_host = WireSettings().effective_nats_url().split("://")[1].split(":")[0]
    assert host.split(".")[1:] == nats_host.split(".")[1:]
    # Never scaled to zero: the sweeper and the DLQ backstop run inside the runners.
    spec = scaled["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
