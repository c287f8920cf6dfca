"""The one exception tree of runfleet.

Every error a caller can act on is a `RunfleetError` with a stable, machine-readable `code`
(snake_case, part of the CLI's `--json` contract) and, where one exists, a `remedy` a person can
follow. Errors from drivers (sqlite3, pymongo, botocore, nats) are translated into this tree at
the module that calls the driver, so nothing above `store/` ever catches a driver's exception.

    RunfleetError
    ├── StoreError                      the store or blob store misbehaved
    │   ├── StoreUnavailable            cannot reach it now (transient: nak, retry)
    │   ├── StoreCorrupt                a file or document is not what we wrote
    │   ├── InvalidStoreUrl             the URL names no backend we can open
    │   ├── DocumentInvalid             a stored document fails validation on read
    │   ├── RunAlreadyExists            create-only met an existing id
    │   ├── RunNotFound                 no run with that id
    │   ├── IllegalTransition           a status write the status table forbids
    │   ├── BlobNotFound                no blob under that key
    │   └── BlobKeyInvalid              a key that escapes the store's prefix
    └── Refusal                         a typed refusal (CLI exit code 3); defined where judged

Packages above `store/` subclass `RunfleetError` (or `Refusal`) in their own `errors.py`.
"""

from __future__ import annotations

from typing import ClassVar


class RunfleetError(Exception):
    """Root of every error runfleet raises on purpose."""

    code: ClassVar[str] = "runfleet_error"
    remedy: str | None = None

    def __init__(self, message: str, *, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if remedy is not None:
            self.remedy = remedy

    def to_dict(self) -> dict[str, object]:
        """The `{"code", "message", "remedy"}` shape the CLI prints with `--json`."""
        out: dict[str, object] = {"code": self.code, "message": self.message}
        if self.remedy:
            out["remedy"] = self.remedy
        return out


class Refusal(RunfleetError):
    """An operation the caller may not do in the current state (CLI exit code 3)."""

    code = "refused"


class StoreError(RunfleetError):
    code = "store_error"


class StoreUnavailable(StoreError):
    """The backend cannot be reached or timed out. Transient: callers retry or nak."""

    code = "store_unavailable"
    remedy = "check that the store is running and reachable, then retry"


class StoreCorrupt(StoreError):
    code = "store_corrupt"
    remedy = "restore the file from a backup or point RUNFLEET_STORE_URL at a healthy store"


class InvalidStoreUrl(StoreError):
    code = "invalid_store_url"
    remedy = "use sqlite:///path, mongodb://host/db, file:///path or s3://bucket/prefix"


class DocumentInvalid(StoreError):
    """A stored record does not validate; it is reported, never silently rewritten."""

    code = "document_invalid"


class RunAlreadyExists(StoreError):
    code = "run_exists"


class RunNotFound(Refusal):
    code = "run_not_found"
    remedy = "check the run id with `runfleet runs`"


class IllegalTransition(StoreError):
    """A compare-and-set asked for a status change the status table does not allow.

    This is a programming error in the caller, not a race: a race is a `CasConflict` result.
    """

    code = "illegal_transition"


class BlobNotFound(StoreError):
    code = "blob_not_found"


class BlobKeyInvalid(StoreError):
    code = "blob_key_invalid"
    remedy = "blob keys are relative paths like runs/<id>/scratch/<token>.tgz, without '..'"
