"""The kubernetes driver's settings and the workflow options it accepts (SPEC §7.1, v2.2).

`KubernetesSandboxSettings` reads `RUNFLEET_SANDBOX_NAMESPACE`, `_IMAGE`, `_POD_TEMPLATE`,
`_SCHEDULE_BUDGET`, `_READY_BUDGET` and `_SEED_BUDGET`; `KubernetesSettings.from_env` checks them
and loads the pod template file once, when the driver is opened (at runner start for
`RUNFLEET_SANDBOX=kubernetes`): a template that does not parse is a start error, not a failure
of the first run. `KubernetesOptions` is the `sandbox.options` mapping a
workflow may give for this driver: the loader validates it, so an unknown option is a load error
with its line. No kubernetes client import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, FilePath, field_validator

from engine.sandbox.protocols import SetupBudgets
from store.errors import RunfleetError
from store.settings import EXISTING_FILE, RunfleetSettings
from store.timeutil import Duration

__all__ = [
    "KubernetesOptions",
    "KubernetesSandboxSettings",
    "KubernetesSettings",
    "KubernetesSettingsInvalid",
    "PodTemplateInvalid",
    "load_pod_template",
]

ResourceName = Literal["cpu", "memory", "ephemeral-storage"]


class KubernetesSettingsInvalid(RunfleetError, code="kubernetes_settings_invalid"):
    """A `RUNFLEET_SANDBOX_*` setting the kubernetes driver cannot start with (configuration,
    raised before any sandbox exists)."""

    remedy = "fix the RUNFLEET_SANDBOX_* setting named (docs/kubernetes.md lists them)"


class PodTemplateInvalid(KubernetesSettingsInvalid, code="pod_template_invalid"):
    """`RUNFLEET_SANDBOX_POD_TEMPLATE` names a file that is not a pod manifest."""


class KubernetesResources(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: dict[ResourceName, str] = Field(default_factory=dict)
    limits: dict[ResourceName, str] = Field(default_factory=dict)


class KubernetesOptions(BaseModel):
    """A workflow's `sandbox.options` for `driver: kubernetes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str | None = Field(default=None, min_length=1)
    """Wins over `RUNFLEET_SANDBOX_IMAGE`."""
    resources: KubernetesResources = Field(default_factory=KubernetesResources)


class KubernetesSandboxSettings(RunfleetSettings):
    """`RUNFLEET_SANDBOX_*`: read when the kubernetes driver is opened (at runner start when
    `RUNFLEET_SANDBOX=kubernetes`), so a wrong value stops the runner before it serves a run
    (a bad value is `SettingsInvalid`, naming the variable: `store.settings`)."""

    sandbox_namespace: str = Field(
        default="runfleet-sandboxes",
        description="the one namespace sandbox pods live in",
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
    )
    sandbox_image: str | None = Field(
        default=None,
        min_length=1,
        description="default image of a sandbox pod; a workflow's sandbox.options.image wins",
    )
    sandbox_pod_template: FilePath | None = Field(
        default=None,
        description="a pod manifest (YAML) merged under the driver's own fields",
        json_schema_extra=EXISTING_FILE,
    )
    sandbox_schedule_budget: Duration = timedelta(minutes=5)
    sandbox_ready_budget: Duration = timedelta(minutes=2)
    sandbox_seed_budget: Duration = timedelta(minutes=2)

    @field_validator("sandbox_schedule_budget", "sandbox_ready_budget", "sandbox_seed_budget")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("a setup phase budget must be > 0")
        return value


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    """What the driver reads, the pod template loaded once."""

    namespace: str
    image: str | None
    budgets: SetupBudgets
    pod_template: Mapping[str, Any] = field(default_factory=dict)
    delete_grace_s: int = 5
    """`gracePeriodSeconds` of a stop's delete: the pod's processes get SIGTERM, then SIGKILL."""
    gone_timeout_s: float = 60.0
    """How long a stop waits to see the pod gone after the delete."""

    @classmethod
    def from_env(cls, *, require_image: bool) -> KubernetesSettings:
        """`RUNFLEET_SANDBOX_*`, checked: a value of the wrong form is `SettingsInvalid`; a
        missing default image (when required) or a template that is not a pod manifest is
        `KubernetesSettingsInvalid`."""
        raw = KubernetesSandboxSettings()  # a bad value: `SettingsInvalid`, naming it
        if require_image and not raw.sandbox_image:
            raise KubernetesSettingsInvalid(
                "RUNFLEET_SANDBOX=kubernetes needs RUNFLEET_SANDBOX_IMAGE, the default image of "
                "a sandbox pod (a workflow's sandbox.options.image wins over it)"
            )
        template: Mapping[str, Any] = {}
        if raw.sandbox_pod_template is not None:
            template = load_pod_template(raw.sandbox_pod_template)
        return cls(
            namespace=raw.sandbox_namespace,
            image=raw.sandbox_image,
            budgets=SetupBudgets(
                schedule_s=raw.sandbox_schedule_budget.total_seconds(),
                ready_s=raw.sandbox_ready_budget.total_seconds(),
                seed_s=raw.sandbox_seed_budget.total_seconds(),
            ),
            pod_template=template,
        )


def load_pod_template(path: Path) -> dict[str, Any]:
    """The YAML pod manifest at `path` as a mapping; `PodTemplateInvalid` naming the file."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PodTemplateInvalid(f"RUNFLEET_SANDBOX_POD_TEMPLATE {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PodTemplateInvalid(f"RUNFLEET_SANDBOX_POD_TEMPLATE {path}: not a mapping")
    kind = data.get("kind", "Pod")
    if kind != "Pod":
        raise PodTemplateInvalid(f"RUNFLEET_SANDBOX_POD_TEMPLATE {path}: kind {kind!r}, not Pod")
    return data
