"""Run documents to and from their storage form (instants as epoch ms, enums as strings)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from store.cas import to_storage
from store.errors import DocumentInvalid

M = TypeVar("M", bound=BaseModel)


def encode(model: BaseModel) -> dict[str, Any]:
    stored = to_storage(model.model_dump(mode="python", exclude_none=False))
    assert isinstance(stored, dict)
    return stored


INVALID_REMEDY = "inspect the record; runfleet never rewrites an invalid record by itself"


def decode(cls: type[M], raw: Any, *, what: str, ident: str) -> M:
    """Validate a stored record; a record that fails is a `DocumentInvalid` naming its id."""
    if isinstance(raw, dict) and "_id" in raw:
        raw = {k: v for k, v in raw.items() if k != "_id"}
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise DocumentInvalid(
            f"stored {what} {ident!r} fails validation at {field!r}: {first['msg']}",
            remedy=INVALID_REMEDY,
        ) from exc
