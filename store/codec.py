"""Run documents to and from their storage form (instants as epoch ms, enums as strings)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from store.cas import to_storage
from store.errors import DocumentInvalid

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


def encode(model: BaseModel) -> dict[str, Any]:
    stored = to_storage(model.model_dump(mode="python", exclude_none=False))
    assert isinstance(stored, dict)
    return stored


INVALID_REMEDY = "inspect the record; runfleet never rewrites an invalid record by itself"


def decode(cls: type[M], raw: Any, *, what: str, ident: str, written: Collection[str] = ()) -> M:
    """Validate a stored record; a record that fails is a `DocumentInvalid` naming its id.

    Fields this build does not know are read without (and kept in storage by the narrow
    writes): a newer build wrote them (ADR-0026). A rollback met every staged upload a newer
    build had written (`claimed_by`) as invalid, and the older sweeper, `gc` and `launch --attach`
    failed on them for good (an upgrade walkthrough). Only unknown fields are forgiven: a
    known field of the wrong shape is still `DocumentInvalid`. The models keep refusing
    unknown fields where a write puts them: `written` (the dotted paths an update sets) makes
    an unknown field at, under or above one of them a `DocumentInvalid` (a misspelt path in a
    compare-and-set), while one the document already carried is kept."""
    if isinstance(raw, dict) and "_id" in raw:
        raw = {k: v for k, v in raw.items() if k != "_id"}
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        known = _without_unknown_fields(raw, exc, written)
        if known is not None:
            return decode(cls, known, what=what, ident=ident)
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise DocumentInvalid(
            f"stored {what} {ident!r} fails validation at {field!r}: {first['msg']}",
            remedy=INVALID_REMEDY,
        ) from exc


_UNKNOWN_SEEN: set[str] = set()


def _without_unknown_fields(raw: Any, exc: ValidationError, written: Collection[str]) -> Any | None:
    """`raw` without the fields `exc` calls unknown, when those are all it found wrong and
    none of them is where this write puts something."""
    errors = exc.errors()
    if not errors or any(e["type"] != "extra_forbidden" for e in errors):
        return None
    for error in errors:
        path = ".".join(str(p) for p in error["loc"])
        if any(_overlaps(path, w) for w in written):
            return None
    known = copy.deepcopy(raw)
    for error in errors:
        *parents, name = error["loc"]
        try:
            node = known
            for part in parents:
                node = node[part]
            del node[name]
        except (KeyError, IndexError, TypeError):  # a path through a union's tag: not ours
            return None
        path = ".".join(str(p) for p in error["loc"])
        if path not in _UNKNOWN_SEEN:  # once per field and process: every read would say it
            _UNKNOWN_SEEN.add(path)
            log.warning("stored records carry %r, unknown to this build: read without it", path)
    return known


def _overlaps(path: str, written: str) -> bool:
    return path == written or path.startswith(f"{written}.") or written.startswith(f"{path}.")
