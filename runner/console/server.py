"""The server the HTTP API (SPEC v2.2 §10c) and the operator console (§10b) share: one aiohttp
application over one `Env` for the process's life, behind two middlewares — errors outermost
(every failure leaves as the one JSON error shape), then auth (no token, no access except
`/healthz`).

It binds 127.0.0.1 unless told otherwise: the API acts on the fleet, and a token file is not a
reason to listen on every interface by default.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from publisher.connection import connect
from publisher.nats_errors import NATS_ERRORS, translate_nats_error
from runner.console.api import ROUTES
from runner.console.auth import TokenBook, TokenSource, bearer
from runner.console.errors import ApiError, error_json, response_for
from runner.console.listening import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    bind_failure,
    url_of,
)
from runner.console.models import Health, Readiness
from runner.console.openapi import document
from runner.console.routing import ENV, PRINCIPAL, TOKENS, endpoint
from runner.console.ui import create_ui
from runner.console.ui_fleet import RUNNERS, RunnerSource
from runner.operations import Env, open_env
from store import RunfleetError, StoreError
from store.settings import SettingsInvalid

if TYPE_CHECKING:
    import socket

log = logging.getLogger(__name__)

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
SHUTDOWN_S = 5.0
"""How long a stop waits for open requests (a followed event stream never ends by itself)."""
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/ui", "/favicon.ico"})
"""Served without a token: health, and the ways into the console (which has its own login)."""
NATS_READY_WITHIN_S = 3.0
"""How long `/readyz` waits for a NATS connection (a probe's own timeout is about this)."""
STORE_READY_WITHIN_S = 3.0
"""How long `/readyz` waits for the store's ping (a probe's own timeout is about this)."""
UI_PREFIX = "/ui"
"""The console's pages: a browser has no bearer header, so they authenticate by their own
session cookie and CSRF token (`pages`, `ui_auth`)."""
BODY_MAX = 4 * 1024 * 1024
"""A workflow source and its vars, or a resume's answers: never near this."""

Next = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPENAPI = web.AppKey("runfleet.openapi", dict[str, Any])


@web.middleware
async def errors_middleware(request: web.Request, handler: Next) -> web.StreamResponse:
    try:
        return await handler(request)
    except (RunfleetError, ApiError) as exc:
        return response_for(exc)
    except NATS_ERRORS as exc:  # one that slipped past an operation's boundary: still typed
        return response_for(translate_nats_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        # RFC 9110 §15.5.6: a 405 says which methods the resource has.
        allow = getattr(exc, "allowed_methods", None)
        headers = {"Allow": ", ".join(sorted(allow))} if allow else None
        code_ = code.get(exc.status, "http_error")
        return response_for(ApiError(exc.status, code_, exc.reason, headers=headers))
    except asyncio.CancelledError:
        raise
    except Exception:  # the last line: logged here, answered without internals
        log.exception("%s %s failed", request.method, request.path)
        return error_json(
            500,
            {
                "code": "internal",
                "message": "internal error (logged)",
                "remedy": "retry; if it persists, the server's log has the cause",
            },
        )


@web.middleware
async def auth_middleware(request: web.Request, handler: Next) -> web.StreamResponse:
    if request.path in OPEN_PATHS or request.path.startswith(f"{UI_PREFIX}/"):
        return await handler(request)
    token = bearer(request.headers.get("Authorization"))
    principal = request.app[TOKENS].book().lookup(token) if token is not None else None
    if principal is None:
        raise ApiError(
            401,
            "unauthorized",
            "a bearer token is required" if token is None else "unknown token",
            "send `Authorization: Bearer <token>` with a token of RUNFLEET_API_TOKENS (or the"
            " RUNFLEET_CONSOLE_TOKEN the server was started with)",
        )
    request[PRINCIPAL] = principal
    return await handler(request)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text=Health().model_dump_json(), content_type="application/json")


async def readyz(request: web.Request) -> web.Response:
    """Readiness, apart from liveness (`/healthz`): every operation but a store read needs
    NATS, so a server whose NATS or store does not answer is taken out of a Service's
    endpoints rather than answering 503 to each caller (found by an API walkthrough: `/healthz`
    said ok with NATS down). A connection per probe: the server holds none between requests.
    It answers without a token (a probe has none), so `problems` holds error codes only; the
    log has the messages."""
    env = request.app[ENV]
    found = await asyncio.gather(_nats_problem(env), _store_problem(env))
    problems = [p for p in found if p is not None]
    body = Readiness(ok=not problems, problems=problems).model_dump_json()
    return web.Response(text=body, status=503 if problems else 200, content_type="application/json")


_ASKING: set[asyncio.Task[str | None]] = set()
"""Readiness questions still waiting on a hung server (held, so they are not collected)."""


async def _nats_problem(env: Env) -> str | None:
    # A hung server took the client's own budgets, ≈ 9 s (an operator walkthrough). The
    # question is not cancelled past the bound (a connect cancelled half-way leaks its socket):
    # it ends by itself, within those budgets, and closes what it opened.
    task = asyncio.ensure_future(_ask_jetstream(env))
    done, _ = await asyncio.wait({task}, timeout=NATS_READY_WITHIN_S)
    if task in done:
        return task.result()
    _ASKING.add(task)
    task.add_done_callback(_ASKING.discard)
    log.warning("not ready: nats: no answer within %g s", NATS_READY_WITHIN_S)
    return "nats: nats_timeout"


async def _ask_jetstream(env: Env) -> str | None:
    try:
        nc, js = await connect(env.nats(), name=f"{env.client}-readyz")
    except RunfleetError as exc:
        return _not_ready("nats", exc)
    try:
        await js.account_info()  # JetStream answers, not only the server
    except NATS_ERRORS as exc:
        return _not_ready("nats", translate_nats_error(exc))
    finally:
        await nc.close()
    return None


def _not_ready(part: str, exc: RunfleetError) -> str:
    log.warning("not ready: %s: %s", part, exc.message)
    return f"{part}: {exc.code}"


async def _store_problem(env: Env) -> str | None:
    try:
        async with asyncio.timeout(STORE_READY_WITHIN_S):
            await env.store.ping()
    except TimeoutError:
        log.warning("not ready: store: no answer within %g s", STORE_READY_WITHIN_S)
        return "store: store_timeout"
    except StoreError as exc:
        return _not_ready("store", exc)
    return None


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


async def home(request: web.Request) -> web.StreamResponse:
    return web.Response(status=303, headers={"Location": f"{UI_PREFIX}/runs"})


async def no_icon(request: web.Request) -> web.Response:
    return web.Response(status=204)


def create_app(
    env: Env,
    tokens: TokenBook | TokenSource,
    *,
    open_reads: bool = True,
    runners: RunnerSource | None = None,
) -> web.Application:
    """The API and the console over an open `env`; the caller owns `env` (opens and closes
    it). `open_reads`: the console's pages read without a login (as `RUNFLEET_TENANT`, role
    `read`) — what `serve` allows only on a loopback interface. `runners`: the runner
    processes' rows for the fleet page, when the server runs inside `runfleet up`."""
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=BODY_MAX
    )
    app[ENV] = env
    if isinstance(tokens, TokenBook):
        tokens = TokenSource.fixed(tokens)
    app[TOKENS] = tokens
    if runners is not None:
        app[RUNNERS] = runners
    app[OPENAPI] = document(ROUTES)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/", home)
    app.router.add_get(UI_PREFIX, home)  # `/ui` answered the API's 401 JSON
    app.router.add_get("/favicon.ico", no_icon)  # browsers ask on every page: not a 401
    app.add_subapp(UI_PREFIX, create_ui(tokens, open_reads=open_reads))
    app.router.add_get("/openapi.json", openapi_json)
    for route in ROUTES:
        app.router.add_route(route.method, route.path, endpoint(route), name=route.operation_id)
    return app


def _warn_of_a_shared_host(env: Env, book: TokenBook) -> None:
    """Tokens of several tenants on the `local` sandbox: the API keeps them apart, but a tool
    node runs on this host as the runner's user and can read every tenant's data and the
    token file (found by a security walkthrough; docs/api.md)."""
    tenants = sorted({who.tenant for who in book.by_digest.values()})
    try:
        sandbox = env.engine.sandbox
    except SettingsInvalid:
        return  # a runner setting the API does not use: not this server's to refuse
    if len(tenants) > 1 and sandbox == "local":
        log.warning(
            "the tokens name %d tenants (%s) and the sandbox is `local`: workflows of one can"
            " read the others' data on this host; serve several tenants with RUNFLEET_SANDBOX="
            "kubernetes (docs/api.md)",
            len(tenants),
            ", ".join(tenants[:5]) + (", ..." if len(tenants) > 5 else ""),
        )


async def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    started: Callable[[str], None] | None = None,
    runners: RunnerSource | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve until cancelled: open the environment from `RUNFLEET_*`, read the tokens, listen
    on `host`:`port` — or on `sock` when the caller bound it already (`listening_socket`).
    `started` is told the URL once the socket listens; `BindFailed` if it cannot listen."""
    async with open_env(client="runfleet-console") as env:
        tokens = TokenSource.from_env(env.tenant)
        if not len(tokens.book()) and runners is None:  # `up` says it in its own words
            log.warning(
                "no RUNFLEET_API_TOKENS or RUNFLEET_CONSOLE_TOKEN: every request is refused"
            )
        _warn_of_a_shared_host(env, tokens.book())
        app = create_app(env, tokens, open_reads=host in LOOPBACK, runners=runners)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        try:
            site: web.BaseSite = (
                web.TCPSite(runner, host, port) if sock is None else web.SockSite(runner, sock)
            )
            try:
                await site.start()
            except OSError as exc:
                raise bind_failure(exc, host, port) from exc
            if started is not None:
                started(url_of(runner.addresses[0] if runner.addresses else (host, port)))
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
