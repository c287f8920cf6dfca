"""The HTTP API as its own Deployment (issue 22 item 2; SPEC v2.2 §10c, §11): stateless, behind
a Service, probed on `/readyz` and `/healthz`, its bearer tokens from a Secret, reading the
runners' ConfigMap and store Secrets. Checked offline on the objects `kubectl kustomize`
renders (the fixtures of conftest.py, the helpers of manifests.py); what the container runs is
resolved against the real CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner.cli.console import console_cmd
from runner.console import server
from runner.console.auth import CONSOLE_TOKEN, TOKENS_FILE, load_tokens
from tests.deploy.manifests import (
    BUILDS,
    OVERLAYS,
    Manifest,
    api_deployment,
    config_map_of,
    container_argv,
    find,
    literal_env,
    one,
    only_container,
    pod_spec,
    runfleet_command,
    runner_deployment,
    workload_env,
)

API_PORT_NAME = "http-api"


def labels_of(deployment: Manifest) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def console_options(container: dict[str, Any]) -> dict[str, Any]:
    """The options `runfleet console` parses from the container's argv."""
    command, path, words = runfleet_command(container_argv(container))
    assert path == ["console"] and command is console_cmd, f"the API runs `runfleet {path}`"
    params: dict[str, Any] = command.make_context("console", list(words)).params
    return params


@pytest.mark.parametrize("build", list(BUILDS))
def test_api_deployment_is_stateless_behind_a_service(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    """SPEC §10c: any replica answers any request, so the API is a plain Deployment whose only
    writable places are emptyDirs (runs, uploads and DLQ records live in the store, the blob
    store and NATS), and callers reach it through one Service that selects the API pods and
    nothing else, on the port `runfleet console` listens on, on every interface."""
    manifests = rendered[build]
    deployment = api_deployment(manifests)
    spec = pod_spec(deployment)
    assert not find(manifests, "StatefulSet") and not find(manifests, "PersistentVolumeClaim")
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= {"emptyDir", "secret"}, volume
    assert deployment["spec"]["replicas"] >= 1
    if build != "dev":
        assert deployment["spec"]["replicas"] >= 2, "one replica is not behind a Service's choice"
    container = only_container(deployment)
    options = console_options(container)
    assert options["host"] == "0.0.0.0", "127.0.0.1 (the default) is unreachable from a Service"
    ports = {p["name"]: p for p in container["ports"]}
    assert ports[API_PORT_NAME]["containerPort"] == options["port"] != 0

    labels = labels_of(deployment)
    (service,) = [s for s in find(manifests, "Service") if selects(s["spec"]["selector"], labels)]
    assert service["metadata"]["name"] == "runfleet-api"
    assert service["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [API_PORT_NAME]
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    # ... and it never sends a caller to a runner (whose only port is its metrics port).
    assert not selects(service["spec"]["selector"], labels_of(runner_deployment(manifests)))
    budget = [
        p
        for p in find(manifests, "PodDisruptionBudget")
        if selects(p["spec"]["selector"]["matchLabels"], labels_of(deployment))
    ]
    assert [p["spec"]["maxUnavailable"] for p in budget] == [1]
    # Not scaled by KEDA (its lag is the runners' work, not the API's).
    targets = {s["spec"]["scaleTargetRef"]["name"] for s in find(manifests, "ScaledObject")}
    assert deployment["metadata"]["name"] not in targets


@pytest.mark.parametrize("build", list(BUILDS))
def test_api_probes_hit_readyz_and_healthz_without_a_token(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    """The kubelet sends no token: readiness asks `/readyz` (NATS and the store answer),
    liveness `/healthz`, paths the server answers without one (`server.OPEN_PATHS`), on the
    API's own port."""
    container = only_container(api_deployment(rendered[build]))
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, API_PORT_NAME), probe
        assert get["path"] in server.OPEN_PATHS


@pytest.mark.parametrize("build", list(BUILDS))
def test_api_token_comes_from_a_secret(
    rendered: dict[str, list[Manifest]], build: str, tmp_path: Path
) -> None:
    """SPEC §10c: `RUNFLEET_API_TOKENS` names a file; in the cluster, the key `tokens` of the
    Secret `runfleet-api-tokens`, mounted read-only, not optional, readable by the pod's user.
    No token is in a ConfigMap or the manifests, and no `RUNFLEET_CONSOLE_TOKEN` (one operate
    token for the default tenant) is set: every token is bound to its tenant in the file."""
    manifests = rendered[build]
    deployment = api_deployment(manifests)
    spec = pod_spec(deployment)
    container = only_container(deployment)
    path = Path(literal_env(container)[TOKENS_FILE])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(path.parent)]
    assert mount["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]
    assert secret["secretName"] == "runfleet-api-tokens" and not secret.get("optional")
    (item,) = [i for i in secret["items"] if i["path"] == path.name]
    mode = item.get("mode", secret["defaultMode"])
    assert mode & 0o002 == 0, "the token file must not be world-writable"
    assert mode & 0o004 or (mode & 0o040 and spec["securityContext"].get("fsGroup"))
    data = config_map_of(manifests, container)["data"]
    assert TOKENS_FILE not in data and CONSOLE_TOKEN not in data
    assert CONSOLE_TOKEN not in {e["name"] for e in container["env"]}
    assert not find(manifests, "Secret"), "secrets are created out of band, never committed"
    # The file format the docs tell operators to put in the Secret is what the server reads.
    stand_in = tmp_path / item["key"]
    stand_in.write_text("# TOKEN TENANT ROLE\nsvc-token acme operate\nro-token acme read\n")
    book = load_tokens("default", {TOKENS_FILE: str(stand_in)})
    assert len(book) == 2
    principal = book.lookup("svc-token")
    assert principal is not None and (principal.tenant, principal.role) == ("acme", "operate")


@pytest.mark.parametrize("build", list(BUILDS))
def test_api_reads_the_runners_configmap_and_image(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    """The same config as the runner: one ConfigMap (NATS, tenant, attachment limits, upload
    TTL), one image; the API's literal env only adds its token file (and, in production, the
    same NATS credential files as the runners)."""
    manifests = rendered[build]
    api = only_container(api_deployment(manifests))
    runner = only_container(runner_deployment(manifests))
    api_cm = config_map_of(manifests, api)
    assert api_cm["metadata"]["name"] == config_map_of(manifests, runner)["metadata"]["name"]
    assert api["image"] == runner["image"]
    api_env = workload_env(manifests, "api")
    runner_env = workload_env(manifests, "runner")
    shared = set(api_env) & set(runner_env)
    assert {k: api_env[k] for k in shared} == {k: runner_env[k] for k in shared}
    assert set(api_env) - set(runner_env) == {TOKENS_FILE}


@pytest.mark.parametrize("build", list(BUILDS))
def test_api_grace_period_covers_the_prestop_sleep_and_the_server_shutdown(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    """The kubelet counts the grace from before preStop; after it, the server waits up to
    `SHUTDOWN_S` for open requests. Both must fit, or a rollout cuts requests off."""
    deployment = api_deployment(rendered[build])
    grace = pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
    command = only_container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert grace >= float(command[1]) + server.SHUTDOWN_S
    rollout = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rollout["maxUnavailable"] == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_network_policy_admits_only_the_api_port_and_no_api_server(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    manifests = rendered[overlay]
    deployment = api_deployment(manifests)
    (policy,) = [
        p
        for p in find(manifests, "NetworkPolicy")
        if p["spec"]["podSelector"].get("matchLabels")
        and selects(p["spec"]["podSelector"]["matchLabels"], labels_of(deployment))
    ]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress = [p for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ingress == [{"port": API_PORT_NAME, "protocol": "TCP"}]
    egress = {
        (p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]
    }
    assert egress == {(53, "UDP"), (53, "TCP"), (4222, "TCP"), (27017, "TCP"), (443, "TCP")}


@pytest.mark.parametrize("build", list(BUILDS))
def test_api_service_account_has_no_rights_and_mounts_no_token(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    """The API starts no sandbox pod: its ServiceAccount is bound to no Role, and no
    Kubernetes token is mounted into its pods."""
    manifests = rendered[build]
    spec = pod_spec(api_deployment(manifests))
    account = one(manifests, "ServiceAccount", spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert spec["automountServiceAccountToken"] is False
    runner_spec = pod_spec(runner_deployment(manifests))
    assert spec["serviceAccountName"] != runner_spec["serviceAccountName"]
    subjects = [s for b in find(manifests, "RoleBinding") for s in b["subjects"]]
    subjects += [s for b in find(manifests, "ClusterRoleBinding") for s in b["subjects"]]
    assert account["metadata"]["name"] not in {s["name"] for s in subjects}
