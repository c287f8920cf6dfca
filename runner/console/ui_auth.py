"""Who is at the browser (SPEC v2.2 §10b): a session cookie, the operator token given once in a
login form, and a CSRF token on every form.

A browser cannot send `Authorization: Bearer` on a plain link or form, so the console keeps a
server-side session per browser: an opaque id in an HttpOnly, SameSite=Strict cookie (never the
token itself, so neither script nor a stolen cookie jar holds the operator token). Logging in
looks the token up in the same `TokenBook` as the API and binds the session to its tenant and
role; a fresh session id is issued at login, so an id planted before it is worth nothing.

Every form carries the session's CSRF token; every POST must return it (checked in constant
time) before any handler runs. Without a login the console reads as the fleet's own tenant with
the `read` role — only when it listens on loopback (`open_reads`); bound to another interface it
asks for a token before showing anything.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from runner.console.auth import Principal

COOKIE = "runfleet_session"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 10_000
"""Anonymous sessions are made on first sight; the oldest go first past this many."""


@dataclass
class Session:
    sid: str
    csrf: str
    principal: Principal | None = None
    flash: str | None = None
    """What the last action did, shown once on the next page."""
    expires: float = field(default_factory=lambda: time.monotonic() + SESSION_TTL_S)


@dataclass(frozen=True)
class Viewer:
    """What a page may show and do for the person at the browser."""

    session: Session
    principal: Principal
    logged_in: bool
    tokens_configured: bool

    @property
    def may_write(self) -> bool:
        return self.logged_in and self.principal.may_write

    @property
    def csrf(self) -> str:
        return self.session.csrf

    @property
    def read_only_reason(self) -> str | None:
        if self.may_write:
            return None
        if not self.tokens_configured:
            return (
                "read-only: this console was started without RUNFLEET_CONSOLE_TOKEN"
                " (or RUNFLEET_API_TOKENS); every write is refused"
            )
        if self.logged_in:
            return "read-only: your token has the read role"
        return "read-only: log in with the operator token to resume, cancel, replay or purge"


class SessionBook:
    """The server's sessions, in memory: a restart logs everyone out, which is fine for a
    console an operator opens by hand."""

    def __init__(self) -> None:
        self._by_sid: OrderedDict[str, Session] = OrderedDict()

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        session = self._by_sid.get(sid)
        if session is None or session.expires < time.monotonic():
            self._by_sid.pop(sid, None)
            return None
        return session

    def new(self, principal: Principal | None = None) -> Session:
        while len(self._by_sid) >= MAX_SESSIONS:
            self._by_sid.popitem(last=False)
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), principal)
        self._by_sid[session.sid] = session
        return session

    def drop(self, sid: str) -> None:
        self._by_sid.pop(sid, None)


def set_cookie(response: web.StreamResponse, session: Session, secure: bool) -> None:
    response.set_cookie(
        COOKIE,
        session.sid,
        httponly=True,
        samesite="Strict",
        path="/",
        secure=secure,
        max_age=int(SESSION_TTL_S),
    )


def csrf_ok(session: Session, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(session.csrf, given)
