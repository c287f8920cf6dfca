"""`open_store(url)`: the one place a store URL becomes a `RunStore` (SPEC §9, §12).

`sqlite:///relative/path.db` and `sqlite:////absolute/path.db` (SQLAlchemy's convention),
`mongodb://…` / `mongodb+srv://…` (the database is the URL's path, default `runfleet`).

A SQLite URL is checked before anything is created on disk: a typo in it (a missing directory,
three slashes where four were meant) would otherwise become a new, empty store that answers "no
runs" and hides the mistake. Only the embedded default (`RUNFLEET_DATA`) has its directory made.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from store.errors import InvalidStoreUrl, StoreError
from store.protocols import RunStore

SQLITE_PREFIX = "sqlite:///"
SQLITE_FORMS = (
    "sqlite:///relative/path.db (three slashes: relative to the current directory) or "
    "sqlite:////absolute/path.db (four slashes)"
)


def redact(url: str) -> str:
    """The URL with any password replaced, safe for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def sqlite_path(url: str) -> Path:
    """The path as written in the URL: relative to the current directory with three slashes."""
    if not url.startswith(SQLITE_PREFIX) or len(url) <= len(SQLITE_PREFIX):
        raise InvalidStoreUrl(f"{url!r} is not a sqlite:///path URL", remedy=f"use {SQLITE_FORMS}")
    return Path(url[len(SQLITE_PREFIX) :])


def _unusable(path: Path, *, create: bool, parents: bool) -> tuple[str, str] | None:
    """Why the store file `path` (absolute) cannot be opened under these rules, and what to
    do about it; None when it can."""
    if path.is_dir():
        return f"{path} is a directory, not a store file", f"name a file: {SQLITE_FORMS}"
    if not parents and not path.parent.is_dir():
        state = "is not a directory" if path.parent.exists() else "does not exist"
        return (
            f"the directory of the store file {path} ({path.parent}) {state}",
            f"create {path.parent} first (it is never made for you), or use {SQLITE_FORMS}",
        )
    if not create and not path.exists():
        return (
            f"no store exists at {path}",
            f"use {SQLITE_FORMS}; a command that makes runs (launch, run, up) creates the store",
        )
    return None


def sqlite_file(url: str, *, create: bool = True, parents: bool = False) -> Path:
    """The absolute path of the store file `url` names, once it is known to be usable: its
    directory exists (unless `parents`, the embedded default's privilege: opening makes it),
    and so does the file unless `create`. Anything else is `InvalidStoreUrl` naming the
    resolved path, the accepted forms and, when a three-slash URL read as absolute would do,
    that URL."""
    written = sqlite_path(url)
    path = Path(os.path.abspath(written))
    unusable = _unusable(path, create=create, parents=parents)
    if unusable is None:
        return path
    problem, remedy = unusable
    if not written.is_absolute():
        problem += f" (three slashes: a path relative to the current directory {Path.cwd()})"
        meant = Path(os.path.abspath(Path("/") / written))
        if _unusable(meant, create=create, parents=parents) is None:
            problem += f"; did you mean sqlite:///{meant}?"
            remedy = f"did you mean sqlite:///{meant}? Else {remedy}"
    raise InvalidStoreUrl(problem, remedy=remedy)


async def open_store(url: str, *, create: bool = True, parents: bool = False) -> RunStore:
    """Open the run store named by `url`; a bad URL or an unreachable backend is a typed
    error naming the (redacted) URL and the cause.

    For SQLite, `create=False` (a command that only reads) refuses a file that does not exist
    rather than creating an empty store, and `parents=True` (only the embedded default under
    `RUNFLEET_DATA`) makes a missing directory; see `sqlite_file`."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        from store.sqlite import SqliteRunStore

        try:
            return await SqliteRunStore.open(sqlite_file(url, create=create, parents=parents))
        except StoreError as exc:
            exc.message = f"{redact(url)}: {exc.message}"
            exc.args = (exc.message,)
            raise
    if scheme in ("mongodb", "mongodb+srv"):
        from store.mongo import MongoRunStore

        return await MongoRunStore.connect(url)
    raise InvalidStoreUrl(f"unsupported store URL {redact(url)!r}")
