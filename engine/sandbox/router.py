"""The runner's driver: `RUNFLEET_SANDBOX`'s, or the one a workflow names (SPEC §6.1, §7.1).

A workflow's `sandbox.driver` wins over `RUNFLEET_SANDBOX`; the runner holds one `DriverRouter`
and `start` picks the driver by `spec.driver`. The default driver is opened at start (so its
settings are checked before the runner serves anything); another is opened the first time a
workflow names it and kept. `stop_others` and `list_sandboxes` go through every driver opened
so far: a runner never asks a cluster it was never configured for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace

from engine.sandbox.errors import SandboxError
from engine.sandbox.protocols import (
    Sandbox,
    SandboxCapabilities,
    SandboxDriver,
    SandboxRef,
    SandboxSpec,
)
from engine.sandbox.registry import DriverContext, open_driver

__all__ = ["DriverRouter"]

log = logging.getLogger(__name__)


class DriverRouter:
    def __init__(self, default: str, context: DriverContext) -> None:
        self._default = default
        self._context = context
        self._drivers: dict[str, SandboxDriver] = {default: open_driver(default, context)}

    @property
    def default(self) -> SandboxDriver:
        return self._drivers[self._default]

    def driver(self, name: str | None) -> SandboxDriver:
        """The driver called `name` (`None`: the default), opened on first use."""
        key = name or self._default
        if key not in self._drivers:
            self._drivers[key] = open_driver(key, replace(self._context, default=False))
        return self._drivers[key]

    @property
    def capabilities(self) -> SandboxCapabilities:
        """The default driver's (a sandbox of another driver answers for its own)."""
        return self.default.capabilities

    async def start(self, spec: SandboxSpec) -> Sandbox:
        return await self.driver(spec.driver).start(spec)

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        stopped: list[str] = []
        for name, driver in list(self._drivers.items()):
            with self._unless_named_only(name, "stop_others"):
                stopped += await driver.stop_others(run_id, keep_token)
        return stopped

    async def list_sandboxes(self) -> list[SandboxRef]:
        refs: list[SandboxRef] = []
        for name, driver in list(self._drivers.items()):
            with self._unless_named_only(name, "list_sandboxes"):
                refs += await driver.list_sandboxes()
        return refs

    @contextlib.contextmanager
    def _unless_named_only(self, name: str, what: str) -> Iterator[None]:
        """A driver only a workflow named that cannot work here (no kubeconfig, say) fails
        the runs that name it, at their sandbox start, and nothing else: its error is logged
        and passed over. Found by a workflow walkthrough: one run naming `kubernetes` on a
        runner without a cluster made every later claim of that runner, compute-only runs
        included, fail `INTERNAL_ERROR` in this call. The default driver's errors stand."""
        try:
            yield
        except SandboxError as exc:
            if name == self._default:
                raise
            log.warning("sandbox driver %r (named by a workflow): %s skipped: %s", name, what, exc)

    async def preflight(self) -> None:
        """The default driver's start-up check, if it has one (the kubernetes driver asks
        whether it may manage sandbox pods); a driver a workflow names is checked by its use."""
        preflight = getattr(self.default, "preflight", None)
        if preflight is not None:
            await preflight()

    async def close(self) -> None:
        """Close the drivers that hold connections (the kubernetes API client)."""
        for driver in self._drivers.values():
            close = getattr(driver, "close", None)
            if close is not None:
                await close()
