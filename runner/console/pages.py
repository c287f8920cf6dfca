"""The operator console's web pages (SPEC v2.2 §10b): an aiohttp sub-application under `/ui`,
server-rendered with Jinja2 (autoescaped: a node's output containing HTML is shown as text) and
made live by the vendored htmx and its SSE extension (`static/`, shipped in the package; no
build step).

This module is the frame every page shares: sessions and CSRF (`ui_auth`), the read-only rule,
the error page, security headers, login and logout. The pages themselves are in `ui_runs`,
`ui_dlq` and `ui_fleet`; each calls `runner.operations` exactly as the CLI and the API do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from publisher.nats_errors import NATS_ERRORS, translate_nats_error
from runner.console.auth import Principal
from runner.console.errors import ApiError, status_for
from runner.console.routing import ENV, Call, scoped
from runner.console.ui_auth import (
    COOKIE,
    Session,
    SessionSigner,
    Viewer,
    csrf_ok,
    is_https,
    set_cookie,
)
from runner.operations.errors import is_refusal
from store import RunfleetError, utcnow

log = logging.getLogger(__name__)

PREFIX = "/ui"
HERE = Path(__file__).parent
SIGNER = web.AppKey("runfleet.ui.signer", SessionSigner)
OPEN_READS = web.AppKey("runfleet.ui.open_reads", bool)
STOPPING = web.AppKey("runfleet.ui.stopping", asyncio.Event)
VIEWER = web.RequestKey("runfleet.ui.viewer", Viewer)
FORM = web.RequestKey("runfleet.ui.form", dict[str, list[str]])
LIVE_POLL_S = 0.5
"""How often a live page's stream looks for changes (the same as `events --follow`)."""
KEEPALIVE_EVERY = 30
"""Polls between keep-alive comments on a quiet stream."""
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)

Next = Callable[[web.Request], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _age(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = max((utcnow() - value).total_seconds(), 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def _cap(value: Any, limit: int = 4000) -> str:
    """A value as text, at most `limit` characters (node outputs can be a megabyte)."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… ({len(text) - limit} more characters; `runfleet status --json`)"


def _compact(value: Any, limit: int = 300) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + " …"


TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
TEMPLATES.filters["age"] = _age
TEMPLATES.filters["cap"] = _cap
TEMPLATES.filters["compact"] = _compact
TEMPLATES.filters["dt"] = lambda d: d.strftime("%Y-%m-%d %H:%M:%S UTC") if d else "-"


def fragment(name: str, **context: Any) -> str:
    return TEMPLATES.get_template(name).render(**context)


def page(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    viewer = request[VIEWER]
    flash, refused = viewer.session.take_flash(), viewer.session.take_refused()
    html = fragment(
        name, viewer=viewer, path=request.path_qs, flash=flash, refused=refused, **context
    )
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


def viewer(request: web.Request) -> Viewer:
    return request[VIEWER]


def call_of(request: web.Request) -> Call:
    """The request as the API's handlers see one: the env scoped to the viewer's tenant, so the
    console reuses their ownership checks (`routing.owned_run`, `dlq_api.owner_of`)."""
    env = request.config_dict[ENV]
    who = request[VIEWER].principal
    return Call(request, scoped(env, who.tenant), who, env.tenant, None)


def form_value(request: web.Request, name: str) -> str:
    values = request[FORM].get(name) or [""]
    return values[0]


def form_values(request: web.Request, name: str) -> list[str]:
    return request[FORM].get(name, [])


def require_write(request: web.Request) -> None:
    who = request[VIEWER]
    if not who.may_write:
        raise ApiError(
            403,
            "forbidden",
            who.read_only_reason or "this console is read-only",
            "log in with the operator token (RUNFLEET_CONSOLE_TOKEN)",
        )


def redirect(location: str) -> web.Response:
    """A 303 to `location` (returned, not raised: a page that acted shows its result)."""
    return web.Response(status=303, headers={"Location": location})


def sse_event(name: str, html: str) -> bytes:
    """One server-sent event whose data is an HTML fragment (every line prefixed)."""
    lines = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
    return f"event: {name}\n{lines}\n".encode()


async def live(
    request: web.Request, render: Callable[[], Awaitable[dict[str, str]]]
) -> web.StreamResponse:
    """A stream of HTML fragments by name: `render` is called every `LIVE_POLL_S`, and each
    fragment that changed since it was last sent goes out as an event of its name (htmx's SSE
    extension swaps it into the element with `sse-swap="<name>"`). A failure to render (the
    store or NATS away) is the `problem` fragment until rendering works again. The stream ends
    when the browser leaves or the server stops (`on_shutdown` sets `STOPPING`, so an open
    page never holds a shutdown for its whole grace)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    stopping = request.app[STOPPING]
    sent: dict[str, str] = {}
    quiet = 0
    try:
        while not stopping.is_set():
            if not session_still_holds(request):
                ended = fragment("_problem.html", error=SESSION_ENDED)
                await response.write(sse_event("problem", ended))
                break
            try:
                fragments = {**await render(), "problem": ""}
            except RunfleetError as exc:
                fragments = {"problem": fragment("_problem.html", error=exc.to_dict())}
            except NATS_ERRORS as exc:  # one a read let through untranslated: still a problem
                error = translate_nats_error(exc).to_dict()
                fragments = {"problem": fragment("_problem.html", error=error)}
            changed = {k: v for k, v in fragments.items() if sent.get(k) != v}
            for name, html in changed.items():
                await response.write(sse_event(name, html))
            sent.update(changed)
            quiet = 0 if changed else quiet + 1
            if quiet >= KEEPALIVE_EVERY:
                await response.write(b": keep-alive\n\n")
                quiet = 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), LIVE_POLL_S)
    except ConnectionResetError:
        pass  # the browser left
    return response


SESSION_ENDED = {
    "code": "unauthorized",
    "message": "this session's token no longer holds (revoked, or given another tenant or"
    " role): nothing more is shown",
    "remedy": "reload the page, and log in again",
}


def session_still_holds(request: web.Request) -> bool:
    """Whether a logged-in viewer's session still maps to the principal the page was opened
    as (a live page looks as it goes: one opened before its token was revoked kept showing
    the tenant's new runs, found by a security walkthrough). A viewer who was not logged in
    reads as the fleet's tenant, which no token file changes."""
    who = request[VIEWER]
    if not who.logged_in:
        return True
    signer = request.app[SIGNER]
    session = signer.load(request.cookies.get(COOKIE))
    return session is not None and signer.principal(session) == who.principal


async def stop_live(app: web.Application) -> None:
    app[STOPPING].set()


def _anonymous(request: web.Request) -> Principal:
    return Principal(request.config_dict[ENV].tenant, "read")


_RUN_ACTION = re.compile(r"^/ui/runs/([^/]+)/[a-z_]+$")


def _refusal_line(exc: RunfleetError) -> str:
    remedy = exc.remedy
    return f"refused ({exc.code}): {exc.message}" + (f" — {remedy}" if remedy else "")


def _error_page(request: web.Request, status: int, error: dict[str, object]) -> web.Response:
    """A refusal's page, with the way back to where the person was: a refused action on a run
    (`/ui/runs/RUN/resume`) links that run's page, whose address a reload can take without
    posting again (found by an operator walkthrough: only "runs · DLQ" was offered)."""
    found = _RUN_ACTION.match(request.path) if request.method == "POST" else None
    back = f"/ui/runs/{found.group(1)}" if found else None
    return page(request, "error.html", status=status, error=error, back=back)


@web.middleware
async def ui_middleware(request: web.Request, handler: Next) -> web.StreamResponse:
    signer = request.app[SIGNER]
    session = signer.load(request.cookies.get(COOKIE)) or Session()
    who = signer.principal(session)
    if who is None:
        session.digest = None  # a token since removed from the book: logged out
    logged_in = who is not None
    principal = who or _anonymous(request)
    request[VIEWER] = Viewer(session, principal, logged_in, bool(len(signer.tokens)))
    response = await _guarded(request, handler, logged_in)
    if session.changed and not response.prepared:
        set_cookie(response, signer.dump(session), is_https(request))
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Cache-Control", "no-store")
    return response


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})


def loopback_host(host: str) -> bool:
    """`host` (a `Host` header: a name and an optional port) names this machine's loopback."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        name, port = (host[: end + 1], host[end + 1 :]) if end >= 0 else (host, "")
    else:
        name, colon, digits = host.partition(":")
        port = colon + digits
    if port and not (port.startswith(":") and port[1:].isascii() and port[1:].isdecimal()):
        return False
    return name in LOOPBACK_NAMES


async def _guarded(request: web.Request, handler: Next, logged_in: bool) -> web.StreamResponse:
    open_path = request.path in (f"{PREFIX}/login",) or request.path.startswith(f"{PREFIX}/static/")
    if request.app[OPEN_READS] and not loopback_host(request.host):
        # Reads need no login because only this machine can connect; a page of another site
        # whose name resolves to 127.0.0.1 (DNS rebinding) connects too, under its own name.
        return _error_page(
            request,
            403,
            {
                "code": "host_not_loopback",
                "message": "this console answers only to a loopback host name,"
                f" not {request.host[:100]!r}",
                "remedy": "open it as http://127.0.0.1:<port>/ or http://localhost:<port>/",
            },
        )
    try:
        if not logged_in and not request.app[OPEN_READS] and not open_path:
            return redirect(f"{PREFIX}/login")
        if request.method == "POST":
            form = await request.post()
            request[FORM] = {k: [str(v) for v in form.getall(k)] for k in form}
            if not csrf_ok(request[VIEWER].session, form_value(request, "csrf") or None):
                raise ApiError(
                    403, "csrf", "the form's CSRF token is missing or stale", "reload the page"
                )
        else:
            request[FORM] = {}
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_page(request, exc.status, {"code": "http_error", "message": exc.reason})
    except ApiError as exc:
        return _error_page(request, exc.status, exc.to_dict())
    except RunfleetError as exc:
        back = _RUN_ACTION.match(request.path) if request.method == "POST" else None
        if back is not None and is_refusal(exc):
            # Back to the run's page, which shows the refusal above it as it is now (found by
            # walkthroughs: a refusal replaced the page, and its address was the POST's).
            request[VIEWER].session.refuse(_refusal_line(exc))
            return redirect(f"{PREFIX}/runs/{back.group(1)}")
        status = status_for(exc)
        body: dict[str, object] = (
            dict(exc.to_dict()) if status != 500 else {"code": exc.code, "message": exc.message}
        )
        return _error_page(request, status, body)
    except NATS_ERRORS as exc:
        return _error_page(request, 503, translate_nats_error(exc).to_dict())
    except asyncio.CancelledError:
        raise
    except Exception:  # the last line: logged here, shown as a page without internals
        log.exception("%s %s failed", request.method, request.path)
        return _error_page(request, 500, {"code": "internal", "message": "internal error (logged)"})


async def login_form(request: web.Request) -> web.Response:
    return page(request, "login.html", problem=None)


async def login(request: web.Request) -> web.StreamResponse:
    signer = request.app[SIGNER]
    token = form_value(request, "token").strip()
    if signer.tokens.lookup(token) is None:
        return page(request, "login.html", status=401, problem="unknown token")
    # A new session, new CSRF nonce: nothing of one planted before the login carries over.
    fresh = Session(digest=signer.session_id(token))
    request[VIEWER].session.changed = False
    response = redirect(f"{PREFIX}/runs")
    set_cookie(response, signer.dump(fresh), is_https(request))
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    request[VIEWER].session.changed = False
    response = redirect(f"{PREFIX}/runs")
    response.del_cookie(COOKIE, path="/")
    return response


async def home(request: web.Request) -> web.StreamResponse:
    return redirect(f"{PREFIX}/runs")
