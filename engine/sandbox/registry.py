"""Sandbox drivers by name (SPEC §7.1, v2.2): the one place a driver name becomes a driver.

`RUNFLEET_SANDBOX` (and, where a workflow names one, its `sandbox.driver`) is looked up here;
an unknown name is `UnknownSandboxDriver`, naming the known ones. Each entry is a factory from
a `DriverContext` to a `SandboxDriver`, importing its own sub-package so a driver's client
library is loaded only when that driver is chosen, and the model of the `sandbox.options` a
workflow may give it (the loader validates options with it: an unknown option is a load error).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from engine.sandbox.errors import UnknownSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesOptions
from engine.sandbox.protocols import SandboxDriver

__all__ = [
    "DriverContext",
    "DriverFactory",
    "LocalOptions",
    "driver_names",
    "open_driver",
    "options_model",
]


@dataclass(frozen=True, slots=True)
class DriverContext:
    """What a driver factory may read; a driver's own settings it reads itself."""

    data_dir: Path
    """`RUNFLEET_DATA`, resolved: the local driver keeps its records under it."""
    default: bool = True
    """The driver is `RUNFLEET_SANDBOX`'s (so its settings must be complete), not only one a
    workflow named."""


DriverFactory = Callable[[DriverContext], SandboxDriver]


class LocalOptions(BaseModel):
    """The local driver takes no options: any is a load error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _local(context: DriverContext) -> SandboxDriver:
    from engine.sandbox.local import LocalSandboxDriver

    return LocalSandboxDriver(context.data_dir)


def _kubernetes(context: DriverContext) -> SandboxDriver:
    from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
    from engine.sandbox.kubernetes.settings import KubernetesSettings

    return KubernetesSandboxDriver(KubernetesSettings.from_env(require_image=context.default))


_FACTORIES: Mapping[str, DriverFactory] = {"local": _local, "kubernetes": _kubernetes}
_OPTIONS: Mapping[str, type[BaseModel]] = {"local": LocalOptions, "kubernetes": KubernetesOptions}


def driver_names() -> tuple[str, ...]:
    """The driver names this build knows, sorted."""
    return tuple(sorted(_FACTORIES))


def options_model(name: str) -> type[BaseModel]:
    """The model of `sandbox.options` for the driver `name`; `UnknownSandboxDriver` if none."""
    try:
        return _OPTIONS[name]
    except KeyError:
        raise UnknownSandboxDriver(name, driver_names()) from None


def open_driver(name: str, context: DriverContext) -> SandboxDriver:
    """The driver called `name`; `UnknownSandboxDriver` if there is none."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise UnknownSandboxDriver(name, driver_names()) from None
    return factory(context)
