"""The kubernetes driver's plumbing (SPEC §7.1, v2.2): its settings, checked at start, and the
workflow's `sandbox: {driver, options}`, where an unknown driver or option is a load error
naming its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import WorkflowInvalid
from engine.loader import load_workflow
from engine.sandbox.kubernetes.settings import (
    KubernetesSettings,
    KubernetesSettingsInvalid,
    PodTemplateInvalid,
)
from store.settings import SettingsInvalid

TOOL = "nodes:\n  a: {kind: tool, run: 'true'}\n"


def _wf(sandbox: str) -> str:
    return f"name: t\nentry: a\n{sandbox}{TOOL}"


def test_workflow_sandbox_unknown_driver_is_a_load_error_naming_the_line() -> None:
    with pytest.raises(WorkflowInvalid) as raised:
        load_workflow(_wf("sandbox:\n  options: {}\n  driver: kubernets\n"), "w.yaml")
    (problem,) = raised.value.problems
    assert (problem.field, problem.line) == ("sandbox.driver", 5)
    assert "kubernets" in problem.message and "kubernetes" in problem.message


def test_workflow_sandbox_unknown_option_is_a_load_error_naming_the_line() -> None:
    text = _wf(
        "sandbox:\n  driver: kubernetes\n  options:\n    image: busybox\n"
        "    imagePulPolicy: Always\n"
    )
    with pytest.raises(WorkflowInvalid) as raised:
        load_workflow(text, "w.yaml")
    (problem,) = raised.value.problems
    assert (problem.field, problem.line) == ("sandbox.options.imagePulPolicy", 7)
    assert problem.message == "unknown field"


def test_workflow_sandbox_local_driver_takes_no_options() -> None:
    with pytest.raises(WorkflowInvalid) as raised:
        load_workflow(_wf("sandbox:\n  driver: local\n  options: {image: x}\n"), "w.yaml")
    assert raised.value.problems[0].field == "sandbox.options.image"


def test_workflow_sandbox_options_need_a_driver() -> None:
    with pytest.raises(WorkflowInvalid) as raised:
        load_workflow(_wf("sandbox:\n  options: {image: x}\n"), "w.yaml")
    assert raised.value.problems[0].line == 4
    assert "driver" in raised.value.problems[0].message


def test_workflow_sandbox_kubernetes_options_load() -> None:
    text = _wf(
        "sandbox:\n  driver: kubernetes\n  options:\n    image: python:3.12-slim\n"
        "    resources: {requests: {cpu: 250m}, limits: {memory: 1Gi}}\n"
    )
    sandbox = load_workflow(text, "w.yaml").workflow.sandbox
    assert sandbox.driver == "kubernetes"
    assert sandbox.options["image"] == "python:3.12-slim"


def test_kubernetes_settings_defaults_one_budget_per_setup_phase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNFLEET_SANDBOX_IMAGE", "busybox")
    settings = KubernetesSettings.from_env(require_image=True)
    assert settings.namespace == "runfleet-sandboxes"
    assert (settings.budgets.schedule_s, settings.budgets.ready_s, settings.budgets.seed_s) == (
        300.0,
        120.0,
        120.0,
    )
    monkeypatch.setenv("RUNFLEET_SANDBOX_SCHEDULE_BUDGET", "30s")
    monkeypatch.setenv("RUNFLEET_SANDBOX_NAMESPACE", "sbx")
    settings = KubernetesSettings.from_env(require_image=True)
    assert (settings.budgets.schedule_s, settings.namespace) == (30.0, "sbx")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("RUNFLEET_SANDBOX_NAMESPACE", "Not_A_Namespace"),
        ("RUNFLEET_SANDBOX_READY_BUDGET", "0"),
        ("RUNFLEET_SANDBOX_SEED_BUDGET", "soon"),
    ],
)
def test_kubernetes_settings_are_validated_at_start(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv("RUNFLEET_SANDBOX_IMAGE", "busybox")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsInvalid) as raised:
        KubernetesSettings.from_env(require_image=True)
    assert raised.value.names == (variable,)


def test_kubernetes_as_the_default_driver_needs_a_default_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RUNFLEET_SANDBOX_IMAGE", raising=False)
    with pytest.raises(KubernetesSettingsInvalid, match="RUNFLEET_SANDBOX_IMAGE"):
        KubernetesSettings.from_env(require_image=True)
    # named only by workflows, which bring their image: no default needed
    assert KubernetesSettings.from_env(require_image=False).image is None


@pytest.mark.parametrize(
    ("text", "match"),
    [("- a list\n", "not a mapping"), ("kind: Deployment\n", "Deployment"), ("a: [\n", "template")],
)
def test_pod_template_that_is_not_a_pod_manifest_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, match: str
) -> None:
    path = tmp_path / "template.yaml"
    path.write_text(text)
    monkeypatch.setenv("RUNFLEET_SANDBOX_POD_TEMPLATE", str(path))
    with pytest.raises(PodTemplateInvalid, match=match):
        KubernetesSettings.from_env(require_image=False)


def test_pod_template_is_loaded_once_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "template.yaml"
    path.write_text("spec:\n  nodeSelector: {pool: sandboxes}\n")
    monkeypatch.setenv("RUNFLEET_SANDBOX_POD_TEMPLATE", str(path))
    settings = KubernetesSettings.from_env(require_image=False)
    path.unlink()
    assert settings.pod_template == {"spec": {"nodeSelector": {"pool": "sandboxes"}}}
