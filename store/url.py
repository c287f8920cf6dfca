"""`open_store(url)`: the one place a store URL becomes a `RunStore` (SPEC §9, §12).

`sqlite:///relative/path.db` and `sqlite:////absolute/path.db` (SQLAlchemy's convention),
`mongodb://…` / `mongodb+srv://…` (the database is the URL's path, default `runfleet`).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from store.errors import InvalidStoreUrl, StoreError
from store.protocols import RunStore


def redact(url: str) -> str:
    """The URL with any password replaced, safe for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def sqlite_path(url: str) -> Path:
    if not url.startswith("sqlite:///") or len(url) <= len("sqlite:///"):
        raise InvalidStoreUrl(f"{url!r} is not a sqlite:///path URL")
    return Path(url[len("sqlite:///") :])


async def open_store(url: str) -> RunStore:
    """Open the run store named by `url`; a bad URL or an unreachable backend is a typed
    error naming the (redacted) URL and the cause."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        from store.sqlite import SqliteRunStore

        try:
            return await SqliteRunStore.open(sqlite_path(url))
        except StoreError as exc:
            exc.message = f"{redact(url)}: {exc.message}"
            exc.args = (exc.message,)
            raise
    if scheme in ("mongodb", "mongodb+srv"):
        from store.mongo import MongoRunStore

        return await MongoRunStore.connect(url)
    raise InvalidStoreUrl(f"unsupported store URL {redact(url)!r}")
