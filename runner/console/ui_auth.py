"""Who is at the browser (SPEC v2.2 §10b): a signed session cookie, the operator token given
once in a login form, and a CSRF token on every form.

A browser cannot send `Authorization: Bearer` on a plain link or form, so after a login the
browser holds a session cookie (HttpOnly, SameSite=Strict) that names the token by a keyed
hash of it, never the token itself nor a plain hash to guess at offline. The cookie is signed
with a key derived from the tokens themselves (`TokenBook.secret`): any replica serving the
same tokens (the cluster runs several behind one Service) accepts a session another made,
nobody without the tokens can forge one (it was derived from their digests, which a cookie
showed: a security walkthrough forged ten-year operate sessions from one cookie), no session
is read past `SESSION_TTL_S` from now, and a token removed from the book ends its sessions at
once (changing the book changes the key). Without any token there is nothing
to log in to, and the key is random.

Every form carries the session's CSRF token (a nonce inside the signed cookie); every POST must
return it (checked in constant time) before any handler runs. Without a login the console reads
as the fleet's own tenant with the `read` role — only when it listens on loopback
(`open_reads`); bound to another interface it asks for a token before showing anything.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from runner.console.auth import Principal, TokenBook, TokenSource, token_digest

COOKIE = "runfleet_session"
SESSION_TTL_S = 12 * 3600.0
FLASH_MAX = 500


@dataclass
class Session:
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    digest: str | None = None
    """The logged-in token's digest; None before a login."""
    expires: float = field(default_factory=lambda: time.time() + SESSION_TTL_S)
    flash: str | None = None
    """What the last action did, shown once on the next page."""
    refused: str | None = None
    """Why the last action was refused, shown once on the page it was asked from."""
    changed: bool = True
    """The browser's cookie must be (re)written."""

    def say(self, message: str) -> None:
        self.flash, self.changed = message[:FLASH_MAX], True

    def take_flash(self) -> str | None:
        return self._take("flash")

    def refuse(self, message: str) -> None:
        self.refused, self.changed = message[:FLASH_MAX], True

    def take_refused(self) -> str | None:
        return self._take("refused")

    def _take(self, name: Literal["flash", "refused"]) -> str | None:
        """The message, once: taking it clears it (and the cookie is written again)."""
        message: str | None = getattr(self, name)
        if message is not None:
            setattr(self, name, None)
            self.changed = True
        return message


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


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionSigner:
    """Writes and reads the session cookie: `payload.signature`, HMAC-SHA256."""

    def __init__(self, source: TokenSource) -> None:
        self.source = source
        self._keyed: tuple[TokenBook, bytes] | None = None
        self._ids: tuple[bytes, dict[str, Principal]] | None = None

    @property
    def tokens(self) -> TokenBook:
        """The tokens as the file says now (`TokenSource`)."""
        return self.source.book()

    @property
    def key(self) -> bytes:
        """From the tokens themselves (`TokenBook.secret`, ADR-0023), so every replica serving
        them signs alike and a change of the tokens logs every console session out. Not from
        their digests: it was, and a session cookie, which holds its token's digest, was all a
        person needed to sign sessions of their own, with any expiry (found by a security
        walkthrough)."""
        book = self.tokens
        if self._keyed is None or self._keyed[0] is not book:
            key = book.secret if len(book) else secrets.token_bytes(32)
            self._keyed = (book, key)
        return self._keyed[1]

    def session_id(self, token: str) -> str:
        """What a session keeps of its token: keyed, so a cookie shows no plain hash of a
        token to guess at offline."""
        return hmac.new(self.key, token_digest(token).encode(), hashlib.sha256).hexdigest()

    def _sign(self, payload: str) -> str:
        return hmac.new(self.key, payload.encode(), hashlib.sha256).hexdigest()

    def dump(self, session: Session) -> str:
        body = {
            "c": session.csrf,
            "d": session.digest,
            "e": session.expires,
            "f": session.flash,
            "r": session.refused,
        }
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{payload}.{self._sign(payload)}"

    def load(self, raw: str | None) -> Session | None:
        """The session a cookie holds; None when there is none, or it is forged, expired or
        malformed (then the browser starts a new anonymous one)."""
        if not raw or "." not in raw or not raw.isascii():
            return None  # the cookie this writes is ASCII; anything else is not one of ours
        payload, _, signature = raw.rpartition(".")
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()):
            return None
        try:
            body = json.loads(_unb64(payload))
            session = Session(
                csrf=str(body["c"]),
                digest=None if body["d"] is None else str(body["d"]),
                expires=float(body["e"]),
                flash=None if body["f"] is None else str(body["f"]),
                refused=None if body.get("r") is None else str(body["r"]),
                changed=False,
            )
        except (ValueError, KeyError, TypeError):
            return None
        now = time.time()
        return session if now < session.expires <= now + SESSION_TTL_S else None

    def principal(self, session: Session) -> Principal | None:
        if not session.digest:
            return None
        return self._by_session_id().get(session.digest)

    def _by_session_id(self) -> Mapping[str, Principal]:
        key = self.key
        if self._ids is None or self._ids[0] is not key:
            ids = {
                hmac.new(key, digest.encode(), hashlib.sha256).hexdigest(): who
                for digest, who in self.tokens.by_digest.items()
            }
            self._ids = (key, ids)
        return self._ids[1]


def is_https(request: web.Request) -> bool:
    """The browser reached us over HTTPS: directly, or through a proxy that terminated TLS and
    says so (`X-Forwarded-Proto`, as an Ingress does); the cookie is then `Secure`."""
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.secure or forwarded == "https"


def set_cookie(response: web.StreamResponse, value: str, secure: bool) -> None:
    response.set_cookie(
        COOKIE,
        value,
        httponly=True,
        samesite="Strict",
        path="/",
        secure=secure,
        max_age=int(SESSION_TTL_S),
    )


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def csrf_ok(session: Session, given: str | None) -> bool:
    """`given` is the session's CSRF token (compared in constant time, as bytes:
    `compare_digest` refuses a str that is not ASCII, and a form field can be anything)."""
    return given is not None and hmac.compare_digest(_bytes(session.csrf), _bytes(given))
