"""Who is asking (SPEC v2.2 §10c): bearer tokens, each bound to one tenant and one role.

`RUNFLEET_API_TOKENS` names a file (a mounted Secret in a cluster) with one token a line:

    <token> <tenant> <role>        # role: read | operate; blank lines and # comments skipped

`RUNFLEET_CONSOLE_TOKEN` adds one `operate` token for `RUNFLEET_TENANT` (the single-user
embedded fleet, §10b). No token, no access except `/healthz`; a `read` token may not write. The
tenant a token is bound to is the only one its requests act for: the routes scope every
operation to it (`api.scoped`), so another tenant's run or record reads as not found.

Tokens are kept by their SHA-256 only, and looked up by the hash of what was presented: no
comparison runs over the secret itself, and a dump of the book holds no usable token.

The file is read again when it changes (`TokenSource`): a token added to or removed from the
mounted Secret takes effect within a second or so of the kubelet swapping the file, without
a restart. A file that no longer reads keeps the tokens read before, and says so in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from store.settings import SettingProblem, SettingsInvalid

log = logging.getLogger(__name__)

Role = Literal["read", "operate"]
ROLES: tuple[Role, ...] = ("read", "operate")
TOKENS_FILE = "RUNFLEET_API_TOKENS"
CONSOLE_TOKEN = "RUNFLEET_CONSOLE_TOKEN"


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    role: Role

    @property
    def may_write(self) -> bool:
        return self.role == "operate"


def token_digest(token: str) -> str:
    """A token's key in the `TokenBook`, and a session's (its SHA-256)."""
    # `surrogatepass`: a header of bytes that are not UTF-8 reaches us with lone surrogates
    # (aiohttp decodes with `surrogateescape`); it hashes to no token's digest, never a 500.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class TokenBook:
    by_digest: Mapping[str, Principal]
    secret: bytes = b""
    """Derived from the tokens themselves, never from their digests: the console signs its
    sessions with it (`SessionSigner`), so what a cookie shows can never sign another."""

    @classmethod
    def of(cls, tokens: Mapping[str, Principal]) -> TokenBook:
        material = "\n".join(sorted(tokens)).encode("utf-8", "surrogatepass")
        secret = hashlib.sha256(b"runfleet console session key\n" + material).digest()
        return cls({token_digest(token): who for token, who in tokens.items()}, secret)

    def lookup(self, token: str) -> Principal | None:
        return self.by_digest.get(token_digest(token))

    def __len__(self) -> int:
        return len(self.by_digest)


def _problem(message: str) -> SettingsInvalid:
    return SettingsInvalid(
        [
            SettingProblem(
                (TOKENS_FILE,),
                f"{TOKENS_FILE}: {message}",
                "one `TOKEN TENANT ROLE` a line, ROLE read or operate",
            )
        ]
    )


def parse_tokens(text: str, source: str) -> dict[str, Principal]:
    """The tokens of a `RUNFLEET_API_TOKENS` file; a line that does not read is a usage error
    naming the file and the line (never the token)."""
    out: dict[str, Principal] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or parts[2] not in ROLES:
            raise _problem(f"{source} line {number} is not `TOKEN TENANT read|operate`")
        token, tenant, role = parts
        if token in out:
            raise _problem(f"{source} line {number} repeats a token")
        out[token] = Principal(tenant, "operate" if role == "operate" else "read")
    return out


def load_tokens(default_tenant: str, environ: Mapping[str, str] | None = None) -> TokenBook:
    """The token book from `RUNFLEET_API_TOKENS` and `RUNFLEET_CONSOLE_TOKEN`; empty when
    neither is set (then every request but `/healthz` is refused)."""
    environ = os.environ if environ is None else environ
    tokens: dict[str, Principal] = {}
    path = environ.get(TOKENS_FILE)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise _problem(f"cannot read {path}: {exc.strerror}") from exc
        tokens.update(parse_tokens(text, path))
    console = environ.get(CONSOLE_TOKEN)
    if console:
        tokens[console] = Principal(default_tenant, "operate")
    return TokenBook.of(tokens)


RECHECK_S = 1.0
"""How often, at most, a request makes the server look whether the token file changed."""


class TokenSource:
    """The token book as the file says now: read again when `RUNFLEET_API_TOKENS` changes
    (its inode, size or modification time: a Secret's update swaps the file), looked at no
    more than once per `RECHECK_S`, on a request (found by an API walkthrough: a revoked token
    worked until a restart)."""

    def __init__(
        self, book: TokenBook, path: Path | None = None, load: Callable[[], TokenBook] | None = None
    ) -> None:
        self._book = book
        self._path = path
        self._load = load
        self._stamp = _stamp(path) if path is not None else None
        self._checked = time.monotonic()

    @classmethod
    def fixed(cls, book: TokenBook) -> TokenSource:
        return cls(book)

    @classmethod
    def from_env(cls, default_tenant: str, environ: Mapping[str, str] | None = None) -> TokenSource:
        """`load_tokens` now (a file that does not read is a usage error, exit 2), and again
        whenever the file changes."""
        environ = dict(os.environ if environ is None else environ)
        path = environ.get(TOKENS_FILE)
        book = load_tokens(default_tenant, environ)
        if not path:
            return cls(book)
        return cls(book, Path(path), lambda: load_tokens(default_tenant, environ))

    def book(self) -> TokenBook:
        if self._path is None or self._load is None:
            return self._book
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return self._book
        self._checked = now
        stamp = _stamp(self._path)
        if stamp == self._stamp:
            return self._book
        self._stamp = stamp
        try:
            fresh = self._load()
        except SettingsInvalid as exc:
            log.error("the tokens read before stay: %s", exc.message)
            return self._book
        log.info("%s changed: %d token(s) now", TOKENS_FILE, len(fresh))
        self._book = fresh
        return fresh


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
