"""Every build renders, and every object it renders is valid, offline (SPEC §11).

- Rendering: the real `kubectl kustomize` for the base and each overlay; when a second `kubectl`
  is on PATH (the one operators run), it must render the same objects.
- Built-in objects: `kubernetes-validate --strict` against the official OpenAPI schemas of
  Kubernetes 1.32 (the oldest version these manifests target) and of the newest version it ships.
- KEDA `ScaledObject` and Prometheus Operator `PodMonitor`: the `cloudcoil` pydantic models
  generated from those projects' CRD schemas; an object must round-trip through its model
  unchanged, so an unknown (misspelled) field fails like a wrong type does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication
from cloudcoil.models.prometheus_operator.v1 import PodMonitor, PrometheusRule
from pydantic import BaseModel

from tests.deploy.manifests import BUILDS, Manifest, kubectl_binary, kustomize_build

K8S_OLDEST = "1.32.0"
K8S_VERSIONS = (K8S_OLDEST, kubernetes_validate.utils.latest_version())
CRD_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TriggerAuthentication,
    ("monitoring.coreos.com/v1", "PodMonitor"): PodMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
}


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
            "PrometheusRule",
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
