"""Settings read from `RUNFLEET_*` variables (SPEC §12), and the one mapping from a validation
failure to the names a person typed (SPEC §10, v2.2).

Every settings model of runfleet derives from `RunfleetSettings`. Reading one that does not
validate raises `SettingsInvalid` — never pydantic's dump —, one problem per variable, each
naming the variable as the user typed it (`RUNFLEET_LEASE_TTL`), the value it held, the form
runfleet accepts and the remedy. A relation between settings (interval ≤ TTL/3, …) is checked by
the model's validator raising `SettingsRelation`, which names the fields it relates; the
mapping turns those into variable names too, with the values as typed (or their defaults).

The accepted form of a field comes from its type (a duration, a size, a whole number in a
range, true/false), or from `json_schema_extra={"accepted": "..."}` where the type cannot say
it (a URL's schemes, a name's characters).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

import annotated_types
from pydantic import AfterValidator, BaseModel, Field, ValidationError
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from store.errors import RunfleetError
from store.sizes import SIZE_FORM, format_size, parse_size

DURATION_FORM = "a duration such as 30s, 5m, 1h or plain seconds"


@dataclass(frozen=True, slots=True)
class SettingProblem:
    """One variable (or one relation between variables) that cannot be used."""

    names: tuple[str, ...]
    """The variables, as the user types them (`RUNFLEET_LEASE_TTL`)."""
    message: str
    remedy: str


class SettingsInvalid(RunfleetError, ValueError, code="settings_invalid"):
    """A `RUNFLEET_*` variable holds a value runfleet cannot use (CLI exit code 2, a usage
    error): each problem names the variable, its value, the accepted form and the remedy.
    Also a `ValueError`, what a bad value is to Python code that constructs settings."""

    def __init__(self, problems: Sequence[SettingProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__(
            "; ".join(p.message for p in self.problems),
            remedy="; ".join(p.remedy for p in self.problems),
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for p in self.problems for name in p.names)


class SettingsRelation(ValueError):
    """Raised by a settings model's validator: `rule` broken between `fields` (field names,
    the first is the one the remedy asks to change)."""

    def __init__(self, fields: Sequence[str], rule: str, remedy: str) -> None:
        super().__init__(rule)
        self.fields = tuple(fields)
        self.rule = rule
        self.remedy = remedy


def duration_at_most(model: BaseModel, small: str, large: str, why: str) -> None:
    """The relation `small <= large` between two duration fields of `model`, or the
    `SettingsRelation` naming both variables, why, and either way to mend it."""
    low, high = getattr(model, small), getattr(model, large)
    if low > high:
        a, b = env_name(small), env_name(large)
        raise SettingsRelation(
            (small, large),
            f"{a} must be at most {b} ({why})",
            f"lower {a} to {format_duration(high)} or less, or raise {b} to"
            f" {format_duration(low)} or more",
        )


class RunfleetSettings(BaseSettings):
    """A settings model read from `RUNFLEET_*`: a value that does not validate is
    `SettingsInvalid`, in the user's names."""

    model_config = SettingsConfigDict(env_prefix="RUNFLEET_", extra="ignore")
    env_prefix: ClassVar[str] = "RUNFLEET_"

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise settings_invalid(type(self), exc, values) from None


_TAKEN_FROM: dict[str, str] = {}
"""Variables this process did not get from its shell, with the file they came from."""


def record_taken(names: Sequence[str], source: str) -> None:
    """Say that `names` were set from `source` (a fleet's `fleet-settings.json`), so a value
    that does not validate is not told "unset it" — the shell never set it (found by an
    operator walkthrough)."""
    for name in names:
        _TAKEN_FROM[name] = source


def _with_source(problem: SettingProblem) -> SettingProblem:
    taken = [name for name in problem.names if name in _TAKEN_FROM]
    if not taken:
        return problem
    where = "; ".join(f"{name} came from {_TAKEN_FROM[name]}" for name in taken)
    remedy = problem.remedy
    if problem.names[0] in _TAKEN_FROM:  # the remedy's "unset it" is about that one
        remedy = _UNSET.sub("", remedy)
    return SettingProblem(
        problem.names,
        f"{problem.message} ({where})",
        f"{remedy} in this shell (a value set here wins over that file); to change the"
        " fleet's own, set it where `runfleet up` runs and restart `up`",
    )


_UNSET = re.compile(r",? or unset it(?: \(default (?:[^()]|\([^()]*\))*\))?")


def env_name(field: str, prefix: str = RunfleetSettings.env_prefix) -> str:
    return f"{prefix}{field.upper()}"


def format_duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _optional_of(annotation: Any) -> Any:
    """`X | None` → `X`."""
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return annotation


def _plain(annotation: Any) -> Any:
    """`X | None` → `X`, and `Annotated[X, ...]` → `X`."""
    inner = _optional_of(annotation)
    return get_args(inner)[0] if get_origin(inner) is Annotated else inner


def _constraints(info: FieldInfo) -> list[Any]:
    """The field's validators and bounds, with those of an `Annotated` type inside `X | None`
    (`PositiveDuration | None`): pydantic keeps only the outer ones on `info.metadata`, and
    such a field's bad value was told to be "a text"."""
    found = list(info.metadata)
    inner = _optional_of(info.annotation)
    if get_origin(inner) is Annotated:
        for meta in get_args(inner)[1:]:
            found.extend(meta.metadata if isinstance(meta, FieldInfo) else [meta])
    return found


def _is_size(info: FieldInfo) -> bool:
    return any(getattr(m, "func", None) is parse_size for m in _constraints(info))


def accepted_form(info: FieldInfo) -> str:
    """What a person may write for this field, in words."""
    extra = info.json_schema_extra
    if isinstance(extra, Mapping) and isinstance(extra.get("accepted"), str):
        return str(extra["accepted"])
    kind = _plain(info.annotation)
    constraints = _constraints(info)
    if kind is timedelta:
        if any(isinstance(m, annotated_types.Gt) for m in constraints):
            return f"a positive {DURATION_FORM.removeprefix('a ')}"
        return DURATION_FORM
    if kind is bool:
        return "true or false"
    if kind is int:
        if _is_size(info):
            return SIZE_FORM
        low = next((m.ge for m in constraints if isinstance(m, annotated_types.Ge)), None)
        high = next((m.le for m in constraints if isinstance(m, annotated_types.Le)), None)
        if low is not None and high is not None:
            return f"a whole number from {low} to {high}"
        if low is not None:
            return f"a whole number of at least {low}"
        return "a whole number"
    if kind is Path:
        return "a path"
    if any(isinstance(m, annotated_types.MinLen) for m in constraints):
        return "a non-empty text"
    return "a text"


def default_text(info: FieldInfo) -> str | None:
    """The default, as a person would write it; None when it has none worth showing."""
    default = info.get_default(call_default_factory=True)
    if default is None:
        desc = info.description or ""
        return desc.removeprefix("default ") if desc.startswith("default ") else None
    if isinstance(default, timedelta):
        return format_duration(default)
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, int) and _is_size(info):
        return format_size(default)
    return str(default) if str(default) != "" else "empty"


def _unset_clause(info: FieldInfo) -> str:
    default = default_text(info)
    return f"or unset it (default {default})" if default else "or unset it"


def _given(model: type[BaseSettings], field: str, init: Mapping[str, Any], prefix: str) -> str:
    """A variable with its value as typed, or as its default."""
    name = env_name(field, prefix)
    if field in init:
        return f"{name}={init[field]!s}"
    if name in os.environ:
        return f"{name}={os.environ[name]}"
    info = model.model_fields[field]
    return f"{name} unset (default {default_text(info) or 'none'})"


def settings_invalid(
    model: type[BaseSettings], exc: ValidationError, init: Mapping[str, Any]
) -> SettingsInvalid:
    """The one mapping from a settings model's validation errors to the user's names."""
    prefix = str(model.model_config.get("env_prefix", RunfleetSettings.env_prefix))
    problems: list[SettingProblem] = []
    for error in exc.errors():
        loc = error.get("loc", ())
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, SettingsRelation):
            given = ", ".join(_given(model, f, init, prefix) for f in cause.fields)
            names = tuple(env_name(f, prefix) for f in cause.fields)
            problems.append(SettingProblem(names, f"{cause.rule} (given {given})", cause.remedy))
            continue
        field = str(loc[0]) if loc else ""
        info = model.model_fields.get(field)
        if info is None:  # a model-level check that did not say which fields: name the model
            problems.append(
                SettingProblem((), f"{model.__name__}: {error['msg']}", "fix the settings named")
            )
            continue
        name = env_name(field, prefix)
        form = accepted_form(info)
        value = error.get("input")
        shown = repr(value) if isinstance(value, str) else str(value)
        problems.append(
            SettingProblem(
                (name,),
                f"{name}={shown} is not accepted: expected {form}",
                f"set {name} to {form}, {_unset_clause(info)}",
            )
        )
    return SettingsInvalid([_with_source(p) for p in problems])


def _usable_data_dir(path: Path) -> Path:
    if str(path) == "":
        raise ValueError("empty path")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    return path


DataDir = Annotated[
    Path,
    AfterValidator(_usable_data_dir),
    Field(json_schema_extra={"accepted": "a directory (it is created when missing)"}),
]
"""`RUNFLEET_DATA`: a directory, or a path where one can be made."""

EXISTING_FILE: JsonDict = {"accepted": "the path of an existing file"}
