"""Compare-and-set: the only way a run document changes (SPEC §2 "Write conditions", ADR-0004).

A write is a list of `Condition`s over the stored document and an `Update`. Each backend runs it
as one single-document atomic operation: SQLite evaluates the conditions with `matches()` inside
an IMMEDIATE transaction; MongoDB turns them into a filter with `to_mongo_filter()` for
`find_one_and_update`. Both see the same storage form (instants as epoch ms, see `codec`), so
`LeaseFree` means the same thing everywhere.

Conditions are deliberately few: equality on scalars, inequality, membership, and the one
"lease free" predicate every rule shares. Equality on whole sub-documents is not offered
(MongoDB compares them field-order-sensitively); carry the `version` read instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from pydantic import BaseModel, ValidationError

from store.errors import IllegalTransition, UnwritablePath
from store.models import Publication, RunDocument, RunStatus
from store.status import check_transitions
from store.timeutil import to_ms

Scalar = str | int | float | bool | None | datetime | Enum


_PLAIN = frozenset({str, int, float, bool, type(None)})


def to_storage(value: Any) -> Any:
    """Python value → storage form: aware datetimes become epoch ms, enums their values.
    Plain JSON types are recognised by exact type first: a checkpoint is mostly those, and the
    ABC checks below were a tenth of a store write's CPU (issue 19)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict:
        return {k if type(k) is str else str(k): to_storage(v) for k, v in value.items()}
    if kind is list:
        return [to_storage(v) for v in value]
    if isinstance(value, datetime):
        return to_ms(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, BaseModel):
        return to_storage(value.model_dump(mode="python"))
    if isinstance(value, Mapping):
        return {str(k): to_storage(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_storage(v) for v in value]
    return value


_SCALARS = (str, int, float, bool, type(None))


def _check_scalar(path: str, value: Any) -> None:
    if type(value) in _SCALARS:  # the common case, without an ABC check (issue 19's profile)
        return
    if isinstance(value, Mapping | list | tuple):
        raise TypeError(f"condition on {path!r}: compare scalars only (carry `version` instead)")


def _lookup(doc: Mapping[str, Any], path: str) -> Any:
    cur: Any = doc
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


@dataclass(frozen=True, slots=True)
class _OnScalar:
    path: str
    value: Scalar

    def __post_init__(self) -> None:
        _check_scalar(self.path, self.value)


@dataclass(frozen=True, slots=True)
class Eq(_OnScalar):
    """`path == value`; `value=None` matches an absent or null field."""


@dataclass(frozen=True, slots=True)
class Ne(_OnScalar):
    """`path != value`; an absent field is "not equal" (as in MongoDB's `$ne`)."""


@dataclass(frozen=True, slots=True)
class In:
    path: str
    values: tuple[Scalar, ...]

    def __post_init__(self) -> None:
        for v in self.values:
            _check_scalar(self.path, v)


@dataclass(frozen=True, slots=True)
class LeaseFree:
    """SPEC §2 "lease free": no lease, or `lease.expires_at + skew <= now`."""

    now: datetime
    skew: timedelta

    @property
    def cutoff_ms(self) -> int:
        return to_ms(self.now) - int(self.skew.total_seconds() * 1000)


Condition = Eq | Ne | In | LeaseFree


def lease_is_free(doc: RunDocument, now: datetime, skew: timedelta) -> bool:
    """The in-memory form of `LeaseFree`, for judging a document already read."""
    return doc.lease is None or doc.lease.expires_at + skew <= now


@dataclass(frozen=True, slots=True)
class Update:
    """Fields to set and unset (dotted paths). `bump_version=False` only for a lease refresh
    and a `publication` write (SPEC §2)."""

    set: Mapping[str, Any] = field(default_factory=dict)
    unset: Sequence[str] = ()
    bump_version: bool = True


@dataclass(frozen=True, slots=True)
class CasConflict:
    """The conditions did not hold. `current` is the document as re-read (None: it vanished)."""

    current: RunDocument | None


def matches(doc: Mapping[str, Any], conditions: Sequence[Condition]) -> bool:
    """Evaluate conditions against a document in storage form."""
    for cond in conditions:
        if isinstance(cond, LeaseFree):
            expires = _lookup(doc, "lease.expires_at")
            if doc.get("lease") is not None and (expires is None or expires > cond.cutoff_ms):
                return False
        elif isinstance(cond, Eq):
            if _lookup(doc, cond.path) != to_storage(cond.value):
                return False
        elif isinstance(cond, Ne):
            if _lookup(doc, cond.path) == to_storage(cond.value):
                return False
        elif _lookup(doc, cond.path) not in [to_storage(v) for v in cond.values]:
            return False
    return True


def to_mongo_filter(run_id: str, conditions: Sequence[Condition]) -> dict[str, Any]:
    clauses: list[dict[str, Any]] = [{"_id": run_id}]
    for cond in conditions:
        if isinstance(cond, LeaseFree):
            clauses.append(
                {"$or": [{"lease": None}, {"lease.expires_at": {"$lte": cond.cutoff_ms}}]}
            )
        elif isinstance(cond, Eq):
            clauses.append({cond.path: to_storage(cond.value)})
        elif isinstance(cond, Ne):
            clauses.append({cond.path: {"$ne": to_storage(cond.value)}})
        else:
            clauses.append({cond.path: {"$in": [to_storage(v) for v in cond.values]}})
    return {"$and": clauses}


def _expected_statuses(conditions: Sequence[Condition]) -> list[RunStatus] | None:
    for cond in conditions:
        if isinstance(cond, Eq) and cond.path == "status" and cond.value is not None:
            return [RunStatus(str(to_storage(cond.value)))]
        if isinstance(cond, In) and cond.path == "status":
            return [RunStatus(str(to_storage(v))) for v in cond.values]
    return None


_TOP_LEVEL = frozenset(RunDocument.model_fields)
_IMMUTABLE = frozenset({"run_id", "tenant", "created_at", "version"})


def _check_disjoint(update: Update) -> None:
    """Two paths of one write may not overlap (`a` with `a.b`, or one path both set and
    unset): `mongod` refuses such an update, the other backends would apply it in dict order."""
    sets, unsets = set(update.set), set(update.unset)
    if both := sorted(sets & unsets):
        raise UnwritablePath(f"{both[0]!r} is both set and unset in one write")
    every = sets | unsets
    for path in sorted(p for p in every if "." in p):  # only a dotted path has a parent
        parts = path.split(".")
        for i in range(1, len(parts)):
            if (parent := ".".join(parts[:i])) in every:
                raise UnwritablePath(f"{path!r} and {parent!r} overlap in one write")


_ALLOWED: set[tuple[Any, ...]] = set()
"""The shapes of writes already allowed (see `check_update`); a few dozen in practice."""
_ALLOWED_MAX = 4096


def check_update(conditions: Sequence[Condition], update: Update) -> None:
    """Refuse, before any I/O, a write no rule allows: an unconditional or illegal status
    write, a write to an immutable or unknown field, two paths that overlap.

    The answer depends only on the write's shape: its paths, the status conditions and the
    status it sets. A shape once allowed is remembered: the product writes a few dozen shapes,
    and checking each write afresh was ≈ 2 % of a runner's CPU (issue 19). A shape that is
    refused is never remembered, so it is refused every time."""
    status_conditions = tuple(
        c for c in conditions if isinstance(c, Eq | In) and c.path == "status"
    )
    shape: tuple[Any, ...] | None = (
        tuple(update.set),
        tuple(update.unset),
        update.set.get("status"),
        status_conditions,
    )
    try:
        if shape in _ALLOWED:
            return
    except TypeError:  # an unhashable status value: checked (and refused) below
        shape = None
    _check_update(conditions, update)
    if shape is not None and len(_ALLOWED) < _ALLOWED_MAX:
        _ALLOWED.add(shape)


def _check_update(conditions: Sequence[Condition], update: Update) -> None:
    _check_disjoint(update)
    for path in [*update.set, *update.unset]:
        top = path.split(".", 1)[0]
        if top not in _TOP_LEVEL:
            raise IllegalTransition(f"unknown run field {path!r}")
        if top in _IMMUTABLE:
            raise IllegalTransition(f"run field {path!r} is not writable")
    if "status" in update.set:
        expected = _expected_statuses(conditions)
        if expected is None:
            raise IllegalTransition("a status write must expect the status it read (SPEC §2)")
        check_transitions(expected, RunStatus(str(to_storage(update.set["status"]))))
    elif "status" in update.unset:
        raise IllegalTransition("status cannot be unset")


@dataclass(frozen=True, slots=True)
class LeaseRefresh:
    """A write that is only a lease refresh: `lease.expires_at` set on the holder's token,
    nothing else (`LeaseKeeper.refresh_once`). Each store writes it narrowly, the one field in
    place, with no read and no re-validation of the whole document: the value's type is known
    and `lease` is a sub-document wherever the token matches. A beat cost ≈ 1.1 ms of CPU, and
    half of it was the whole-document compare-and-set (issue 19, lever 2)."""

    token: str
    expires_at_ms: int


def lease_refresh(conditions: Sequence[Condition], update: Update) -> LeaseRefresh | None:
    """The refresh `conditions` and `update` make, or None for any other write."""
    if update.bump_version or update.unset or len(update.set) != 1 or len(conditions) != 1:
        return None
    (cond,) = conditions
    expires_at = update.set.get("lease.expires_at")
    if not isinstance(cond, Eq) or cond.path != "lease.token" or type(cond.value) is not str:
        return None
    if not isinstance(expires_at, datetime):
        return None
    return LeaseRefresh(cond.value, to_ms(expires_at))


@dataclass(frozen=True, slots=True)
class PublicationRecord:
    """A write that only records which copy carries the run (`Publisher.record_publication`):
    `publication` set whole on the attempt it names, unless it already names that stream
    sequence, with no version bump. Like the lease refresh, each store writes it narrowly: the
    one field it touches is validated (as a `Publication`), the rest of the document is neither
    read nor re-validated. A launch wrote it after every publish, at ≈ 0.25 ms of CPU in the
    general compare-and-set (issue 19, lever 2)."""

    attempt: int
    not_stream_seq: int
    publication: dict[str, Any]
    """Its storage form, keys in the order the general path would write them."""


_PUBLICATION_KEYS = ("attempt", "stream_seq", "at", "msg_id")


def publication_record(conditions: Sequence[Condition], update: Update) -> PublicationRecord | None:
    """The record `conditions` and `update` make, or None for any other write (and for a value
    that is not a valid `Publication`: the general path refuses it, and says why)."""
    if update.bump_version or update.unset or len(update.set) != 1 or len(conditions) != 2:
        return None
    on_attempt, not_seq = conditions
    if not (isinstance(on_attempt, Eq) and on_attempt.path == "attempt"):
        return None
    if not (isinstance(not_seq, Ne) and not_seq.path == "publication.stream_seq"):
        return None
    if type(on_attempt.value) is not int or type(not_seq.value) is not int:
        return None
    value = update.set.get("publication")
    if not isinstance(value, dict) or tuple(value) != _PUBLICATION_KEYS:
        return None
    try:
        Publication.model_validate(value)
    except ValidationError:
        return None
    return PublicationRecord(on_attempt.value, not_seq.value, to_storage(value))


NarrowWrite = LeaseRefresh | PublicationRecord


def narrow_write(conditions: Sequence[Condition], update: Update) -> NarrowWrite | None:
    """The narrow write `conditions` and `update` make, or None for a general one."""
    return lease_refresh(conditions, update) or publication_record(conditions, update)


def apply_update(doc: dict[str, Any], update: Update, now_ms: int) -> dict[str, Any]:
    """Apply an update to a storage-form document. Returns a new dict and leaves `doc` as it
    was; only the dicts on an updated path are copied (a full deep copy of the document was a
    measurable share of every write, docs/performance.md fix 4).

    A set path creates its absent parents, as MongoDB's `$set` does, but a parent that is
    present and not a sub-document (null, a scalar, a list) is `UnwritablePath`: `mongod`
    refuses that write, so every backend refuses it before writing (SQLite by calling this,
    MongoDB on its pre-read)."""
    out = dict(doc)
    copied: set[int] = {id(out)}

    def child(parent: dict[str, Any], key: str) -> dict[str, Any] | None:
        nxt = parent.get(key)
        if not isinstance(nxt, dict):
            return None
        if id(nxt) not in copied:
            nxt = dict(nxt)
            parent[key] = nxt
            copied.add(id(nxt))
        return nxt

    for path, value in update.set.items():
        parts = path.split(".")
        cur = out
        for depth, part in enumerate(parts[:-1], start=1):
            nxt = child(cur, part)
            if nxt is None:
                if part in cur:
                    parent = ".".join(parts[:depth])
                    kind = "null" if cur[part] is None else f"a {type(cur[part]).__name__}"
                    raise UnwritablePath(
                        f"cannot set {path!r}: {parent!r} is {kind}, not a sub-document"
                        f" (set the whole {parent!r} instead)"
                    )
                nxt = {}
                cur[part] = nxt
                copied.add(id(nxt))
            cur = nxt
        cur[parts[-1]] = to_storage(value)
    for path in update.unset:
        parts = path.split(".")
        target: dict[str, Any] | None = out
        for part in parts[:-1]:
            target = child(target, part) if target is not None else None
        if target is not None:
            target.pop(parts[-1], None)
    if update.bump_version:
        out["version"] = int(out.get("version", 1)) + 1
        out["updated_at"] = now_ms
    return out
