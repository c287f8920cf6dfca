"""The operator console's pages (SPEC v2.2 §10b) as one aiohttp sub-application, mounted at
`/ui` on the API's app (`server.create_app`): the frame and login of `pages`, the runs of
`ui_runs`, the DLQ of `ui_dlq`, the fleet of `ui_fleet`, and the vendored assets of `static/`.

    pages     sessions, CSRF, read-only rule, error page, live fragments (SSE), login/logout
    ui_auth   the signed session cookie, the viewer
    ui_runs   runs list, a run, its timeline, answer/resume/cancel/rewind
    ui_dlq    records, a record, replay, purge with confirmation
    ui_fleet  runners, leases, the work consumer
    remedies  what to do about each failure code
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from runner.console import ui_dlq, ui_fleet, ui_runs
from runner.console.auth import TokenSource
from runner.console.pages import (
    HERE,
    OPEN_READS,
    SIGNER,
    STOPPING,
    home,
    login,
    login_form,
    logout,
    stop_live,
    ui_middleware,
)
from runner.console.ui_auth import SessionSigner


def create_ui(tokens: TokenSource, *, open_reads: bool) -> web.Application:
    """The console's pages, to mount at `pages.PREFIX` on the API's app (they read its `ENV`
    through `config_dict`). `open_reads`: reading needs no login (loopback only)."""
    ui = web.Application(middlewares=[ui_middleware])
    ui[SIGNER] = SessionSigner(tokens)
    ui[STOPPING] = asyncio.Event()
    ui.on_shutdown.append(stop_live)
    ui[OPEN_READS] = open_reads
    ui.router.add_get("", home)
    ui.router.add_get("/", home)
    ui.router.add_get("/login", login_form)
    ui.router.add_post("/login", login)
    ui.router.add_post("/logout", logout)
    ui.router.add_static("/static", HERE / "static")
    ui_runs.add_routes(ui.router)
    ui_dlq.add_routes(ui.router)
    ui_fleet.add_routes(ui.router)
    return ui
