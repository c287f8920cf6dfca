"""Sandbox drivers by name (SPEC §7.1, v2.2): the one place a driver name becomes a driver.

`RUNFLEET_SANDBOX` (and, where a workflow names one, its `sandbox.driver`) is looked up here;
an unknown name is `UnknownSandboxDriver`, naming the known ones. A new driver (kubernetes)
plugs in as one more entry of `_FACTORIES`: a function from a `DriverContext` to a
`SandboxDriver`, importing its own sub-package so a driver's client library is loaded only
when that driver is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.sandbox.errors import UnknownSandboxDriver
from engine.sandbox.protocols import SandboxDriver

__all__ = ["DriverContext", "DriverFactory", "driver_names", "open_driver"]


@dataclass(frozen=True, slots=True)
class DriverContext:
    """What a driver factory may read; a driver's own settings it reads itself."""

    data_dir: Path
    """`RUNFLEET_DATA`, resolved: the local driver keeps its records under it."""


DriverFactory = Callable[[DriverContext], SandboxDriver]


def _local(context: DriverContext) -> SandboxDriver:
    from engine.sandbox.local import LocalSandboxDriver

    return LocalSandboxDriver(context.data_dir)


_FACTORIES: Mapping[str, DriverFactory] = {"local": _local}


def driver_names() -> tuple[str, ...]:
    """The driver names this build knows, sorted."""
    return tuple(sorted(_FACTORIES))


def open_driver(name: str, context: DriverContext) -> SandboxDriver:
    """The driver called `name`; `UnknownSandboxDriver` if there is none."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise UnknownSandboxDriver(name, driver_names()) from None
    return factory(context)
