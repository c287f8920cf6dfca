"""`/healthz`, `/readyz`, `/metrics` on one port (SPEC §5.8), served by aiohttp.

`/healthz` fails when the fetch loop has made no progress recently (a stalled loop must not
look healthy); `/readyz` fails while NATS is disconnected, the store does not answer, or the
runner drains (so Kubernetes stops routing to it)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runner.config import RunnerSettings
from runner.metrics import RunnerMetrics
from store import RunStore, StoreError
from store.settings import SettingProblem, SettingsInvalid


class _Connection(Protocol):
    @property
    def is_connected(self) -> bool: ...


class _Wire(Protocol):
    """The part of `RunnerServices` readiness reads."""

    @property
    def nc(self) -> _Connection: ...
    @property
    def draining(self) -> bool: ...


class HealthSource(Protocol):
    """What the three endpoints read of a runner, and nothing more.

    `runner.Runner` satisfies it structurally, so this module never imports the runner (the
    arrow points one way: runner → health). The members are read-only properties, so a test's
    fake (or a console) needs only these few facts."""

    @property
    def svc(self) -> _Wire | None:
        """The NATS connection and the draining flag; `None` before the runner started."""
        ...

    @property
    def store(self) -> RunStore: ...
    @property
    def settings(self) -> RunnerSettings: ...
    @property
    def metrics(self) -> RunnerMetrics: ...
    @property
    def last_progress(self) -> float:
        """`time.monotonic()` of the fetch loop's last progress."""
        ...

    def health(self) -> dict[str, Any]:
        """The `/healthz` body (owner, inflight, slots, draining, since_progress_s)."""
        ...


class HealthServer:
    def __init__(self, runner: HealthSource) -> None:
        self.runner = runner
        self.port = 0
        self._site_runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        self._site_runner = web.AppRunner(app, access_log=None)
        await self._site_runner.setup()
        site = web.TCPSite(self._site_runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self._site_runner.cleanup()
            self._site_runner = None
            # The settings that chose it, not `internal` (an operator walkthrough: a port in
            # use restarted the runner in a loop with `OSError(98 …)` and no remedy).
            raise SettingsInvalid(
                [
                    SettingProblem(
                        ("RUNFLEET_HTTP_PORT", "RUNFLEET_HTTP_HOST"),
                        f"RUNFLEET_HTTP_PORT={port} on RUNFLEET_HTTP_HOST={host}: the runner's"
                        f" health and metrics server cannot listen there ({exc.strerror or exc})",
                        "set RUNFLEET_HTTP_PORT to a free port, or 0 for any free one (each"
                        " runner on a machine needs its own)",
                    )
                ]
            ) from exc
        addresses = self._site_runner.addresses
        self.port = int(addresses[0][1]) if addresses else port

    async def stop(self) -> None:
        if self._site_runner is not None:
            await self._site_runner.cleanup()
            self._site_runner = None

    async def healthz(self, request: web.Request) -> web.Response:
        body = self.runner.health()
        stale = time.monotonic() - self.runner.last_progress
        ok = stale <= self.runner.settings.healthy_within.total_seconds()
        return web.json_response({**body, "ok": ok}, status=200 if ok else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        problems: list[str] = []
        svc = self.runner.svc
        if svc is None or not svc.nc.is_connected:
            problems.append("nats disconnected")
        if svc is not None and svc.draining:
            problems.append("draining")
        try:
            await self.runner.store.ping()
        except StoreError as exc:
            problems.append(f"store: {exc.message}")
        status = 200 if not problems else 503
        return web.json_response({"ok": not problems, "problems": problems}, status=status)

    async def metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.runner.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})
