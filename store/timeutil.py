"""Time at module boundaries: timezone-aware UTC, millisecond precision.

Stored documents keep instants as epoch milliseconds (SPEC §1), so MongoDB (which truncates to
milliseconds) and SQLite compare lease expiries in one convention. In memory they are aware
`datetime`s; a naive datetime is refused where it would cross a boundary.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer


def utcnow() -> datetime:
    """Now, aware UTC, truncated to the millisecond so it round-trips through any store. Built
    from the epoch in whole milliseconds (the same clock as `datetime.now`): 40 % cheaper than
    truncating `datetime.now(UTC)`, and a delivery asks for now a dozen times (issue 19)."""
    return _EPOCH + timedelta(milliseconds=time.time_ns() // 1_000_000)


def truncate_ms(value: datetime) -> datetime:
    if not value.microsecond % 1000:
        return value
    return value.replace(microsecond=value.microsecond - value.microsecond % 1000)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def to_ms(value: datetime) -> int:
    if value.tzinfo is None:
        raise ValueError("naive datetime: runfleet only accepts timezone-aware UTC instants")
    return (value - _EPOCH) // _MS  # aware minus aware: any zone, no conversion needed


def iso_z(value: datetime) -> str:
    """The one timestamp format of `--json`, the HTTP API and the messages: ISO 8601 in UTC
    with `Z` and always six digits of fraction (`2026-12-01T15:00:11.189000Z`,
    `2026-12-01T15:00:11.000000Z`), so the strings sort as the instants do. (pydantic's own
    format drops a zero fraction, and `…:11Z` sorts after `…:11.189000Z`: a clock review.)"""
    if value.tzinfo is not UTC:  # every instant a model holds is UTC already (`_coerce_utc`)
        if value.tzinfo is None:
            raise ValueError("naive datetime: runfleet only accepts timezone-aware UTC instants")
        value = value.astimezone(UTC)
    return value.isoformat(timespec="microseconds")[:-6] + "Z"  # "+00:00" → "Z"


def from_ms(value: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=value)


def _coerce_utc(value: Any) -> Any:
    if type(value) is int:  # storage form, the common case: epoch ms
        return _EPOCH + timedelta(milliseconds=value)
    if isinstance(value, bool):
        raise ValueError("expected an instant, got a bool")
    if isinstance(value, int):
        return from_ms(value)
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        if value.tzinfo is UTC and not value.microsecond % 1000:
            return value  # already what it would become: most instants a model is given
        if value.tzinfo is None:
            raise ValueError("naive datetime: runfleet only accepts timezone-aware UTC instants")
        return truncate_ms(value.astimezone(UTC))
    return value


def _json_instant(value: datetime) -> datetime | str:
    """`iso_z`'s text only where the JSON writer's own would differ (a zero fraction, which it
    drops): its own is a quarter of the cost, and this runs once a message (issue 19)."""
    return value if value.microsecond else iso_z(value)


UtcDatetime = Annotated[
    datetime, BeforeValidator(_coerce_utc), PlainSerializer(_json_instant, when_used="json")
]
"""An aware UTC instant at millisecond precision; accepts epoch ms (storage) or ISO text, and
is written in JSON as `iso_z` writes it."""


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_DURATION = timedelta(days=36525)
"""The longest duration accepted: 100 years. Longer is never meant (every setting is minutes or
days), and `now - duration` must stay a datetime: `1e300` seconds or `999999999d` would not."""


def _number(text: str, value: Any) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a duration (use e.g. 30s, 5m, 1h or seconds)") from None


def parse_duration(value: Any) -> timedelta:
    """`30s`, `5m`, `1h`, `250ms`, `1d`, or plain seconds (int, float or numeric text); from 0
    to `MAX_DURATION` (100 years). Anything else is a `ValueError` naming the value."""
    if isinstance(value, timedelta):
        if value > MAX_DURATION:
            raise ValueError(f"duration {value} is longer than 100 years")
        return value
    if isinstance(value, bool):
        raise ValueError("a duration, not a bool")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int past a float's range
            seconds = math.inf
    else:
        text = str(value).strip().lower()
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit) and text[: -len(unit)].strip():
                seconds = _number(text[: -len(unit)].strip(), value) * _UNITS[unit]
                break
        else:
            seconds = _number(text, value)
    if math.isnan(seconds):
        raise ValueError(f"{value!r} is not a duration (not a number)")
    if seconds < 0:
        raise ValueError(f"duration {value!r} is negative")
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError(f"duration {str(value)[:40]!r} is longer than 100 years")
    return timedelta(seconds=seconds)


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]
"""A non-negative duration from `30s`, `5m`, `1h` or plain seconds, at most 100 years."""

PositiveDuration = Annotated[timedelta, BeforeValidator(parse_duration), Field(gt=timedelta(0))]
"""A `Duration` of more than 0: a lease TTL, an interval, a delay, a budget. Zero was taken and
did harm without a word (a clocks review): a TTL of 0 parked every run, a transient delay of 0
became nats-py's plain nak (no delay) and spent a run's deliveries in milliseconds, an interval
of 0 refreshed leases back to back."""
