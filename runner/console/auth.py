"""Who is asking (SPEC v2.2 §10c): bearer tokens, each bound to one tenant and one role.

`RUNFLEET_API_TOKENS` names a file (a mounted Secret in a cluster) with one token a line:

    <token> <tenant> <role>        # role: read | operate; blank lines and # comments skipped

`RUNFLEET_CONSOLE_TOKEN` adds one `operate` token for `RUNFLEET_TENANT` (the single-user
embedded fleet, §10b). No token, no access except `/healthz`; a `read` token may not write. The
tenant a token is bound to is the only one its requests act for: the routes scope every
operation to it (`api.scoped`), so another tenant's run or record reads as not found.

Tokens are kept by their SHA-256 only, and looked up by the hash of what was presented: no
comparison runs over the secret itself, and a dump of the book holds no usable token.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from store.settings import SettingProblem, SettingsInvalid

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


def _digest(token: str) -> str:
    # `surrogatepass`: a header of bytes that are not UTF-8 reaches us with lone surrogates
    # (aiohttp decodes with `surrogateescape`); it hashes to no token's digest, never a 500.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class TokenBook:
    by_digest: Mapping[str, Principal]

    @classmethod
    def of(cls, tokens: Mapping[str, Principal]) -> TokenBook:
        return cls({_digest(token): who for token, who in tokens.items()})

    def lookup(self, token: str) -> Principal | None:
        return self.by_digest.get(_digest(token))

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


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
