"""The production overlay's NATS credentials, TLS and KEDA account, and the kubernetes sandbox
driver's settings in the ConfigMap (issue 16 items 1, 2; SPEC §7.1, §11, §12), checked offline on
the objects `kubectl kustomize` renders (the fixtures of conftest.py, the helpers of
manifests.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.sandbox.kubernetes.settings import KubernetesSandboxSettings, KubernetesSettings
from publisher.config import NatsSettings, split_servers
from store.settings import EXISTING_FILE
from tests.deploy.manifests import (
    SECRET_FILE_SETTINGS,
    WORKLOADS,
    Manifest,
    config_map_of,
    find,
    literal_env,
    nats_values,
    one,
    only_container,
    pod_spec,
    runner_deployment,
    runner_env,
    trigger_auth_parameters,
    workload,
)


def test_keda_reads_the_nats_account_from_a_secret_by_name(
    rendered: dict[str, list[Manifest]],
) -> None:
    """With NATS credentials (JWT accounts) the streams are not in `$G`: KEDA's scaler takes
    `account` from a TriggerAuthentication (it accepts `account` and
    `natsServerMonitoringEndpoint` there), which names a Secret and a key, never a value."""
    manifests = rendered["production"]
    (trigger,) = one(manifests, "ScaledObject")["spec"]["triggers"]
    assert trigger_auth_parameters(manifests, trigger) == {"account"}
    assert "account" not in trigger["metadata"]
    assert not find(manifests, "Secret")
    for build in ("base", "dev"):
        assert not find(rendered[build], "TriggerAuthentication")


@pytest.mark.parametrize("which", list(WORKLOADS))
def test_nats_credentials_and_tls_are_mounted_secret_keys(
    rendered: dict[str, list[Manifest]],
    which: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    """Production: RUNFLEET_NATS_CREDS and RUNFLEET_NATS_TLS_CA (the settings
    publisher/connection.py turns into `user_credentials` and a TLS context) name keys of
    Secrets mounted read-only, referenced by name, not optional, readable by the pod's user;
    the same in the runners, the HTTP API and the streams Job, which all connect."""
    manifests = rendered["production"]
    declared = {
        f"RUNFLEET_{name.upper()}"
        for name, field in NatsSettings.model_fields.items()
        if field.json_schema_extra == EXISTING_FILE
    }
    assert declared == SECRET_FILE_SETTINGS
    obj = workload(manifests, which)
    spec = pod_spec(obj)
    container = only_container(obj)
    env = literal_env(container)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for name in sorted(SECRET_FILE_SETTINGS):
        path = Path(env[name])
        mount = mounts[str(path.parent)]
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"].startswith("runfleet-") and not secret.get("optional")
        (item,) = [i for i in secret["items"] if i["path"] == path.name]
        mode = item.get("mode", secret["defaultMode"])
        user_reads = mode & 0o004 or (mode & 0o040 and spec["securityContext"].get("fsGroup"))
        assert user_reads, f"{name}: mode {oct(mode)} is not readable by the pod's user"
        assert name not in config_map_of(manifests, container)["data"]
    runner = literal_env(only_container(runner_deployment(manifests)))
    assert {k: env[k] for k in SECRET_FILE_SETTINGS} == {k: runner[k] for k in SECRET_FILE_SETTINGS}
    settings_env(runner_env(manifests))
    assert all(url.startswith("tls://") for url in NatsSettings().nats_servers())
    # ... and the NATS each overlay runs on speaks TLS exactly when its runners expect it.
    assert nats_values("production")["config"]["nats"]["tls"]["enabled"] is True
    assert nats_values("dev")["config"]["nats"]["tls"]["enabled"] is False
    assert all(
        u.startswith("nats://")
        for u in split_servers(runner_env(rendered["dev"])["RUNFLEET_NATS_URL"])
    )


@pytest.mark.parametrize("build", ["base", "production"])
def test_base_and_production_run_sandboxes_on_kubernetes_from_the_configmap(
    rendered: dict[str, list[Manifest]],
    build: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    """SPEC §7.1, §12: the driver, its namespace (the Role's), its default image and every
    setup budget are in the generated ConfigMap, and the driver's own settings accept them."""
    manifests = rendered[build]
    data = config_map_of(manifests, only_container(runner_deployment(manifests)))["data"]
    assert data["RUNFLEET_SANDBOX"] == "kubernetes"
    wanted = {
        f"RUNFLEET_{name.upper()}"
        for name in KubernetesSandboxSettings.model_fields
        if name != "sandbox_pod_template"  # optional: a file an operator mounts
    }
    assert wanted <= set(data), f"missing from the ConfigMap: {sorted(wanted - set(data))}"
    settings_env(data)
    driver = KubernetesSettings.from_env(require_image=True)
    assert driver.namespace == one(manifests, "Role")["metadata"]["namespace"]
    assert driver.image == data["RUNFLEET_SANDBOX_IMAGE"]
    assert min(driver.budgets.schedule_s, driver.budgets.ready_s, driver.budgets.seed_s) > 0
