"""Option parsing shared by the commands (`--var`, `--answer`, budgets, progress)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from runner.cli.views import event_line
from store import Budget, Event
from store.settings import DURATION_FORM
from store.timeutil import parse_duration


class DurationParam(click.ParamType[timedelta]):
    """A flag that takes a duration (`--since 1h`): a bad value is a usage error (exit 2)
    naming the flag, the value and the accepted form, as a bad setting is (SPEC §10)."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        try:
            return parse_duration(value)
        except ValueError:
            self.fail(f"{value!r} is not accepted: expected {DURATION_FORM}", param, ctx)


DURATION = DurationParam()


class UsdParam(click.ParamType[float]):
    """A cost cap in USD: a finite number from 0 to 10**12, as the API and the workflow loader
    accept. `float` alone took `nan`, which no cost ever passes (every comparison is false) and
    which `--json` then printed as a bare `NaN`."""

    name = "usd"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            usd = float(value)
        except (TypeError, ValueError):
            usd = math.nan
        if not (0 <= usd <= MAX_USD):  # NaN fails every comparison
            self.fail(
                f"{value!r} is not accepted: expected a number of USD from 0 to {MAX_USD:.0e}",
                param,
                ctx,
            )
        return usd


MAX_USD = 1e12
USD = UsdParam()


def parse_pairs(pairs: tuple[str, ...], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.UsageError(f"{flag} expects name=value, got {pair!r}")
        out[key] = value
    return out


def read_answers_file(
    ctx: click.Context, param: click.Parameter, path: Path | None
) -> dict[str, Any]:
    """`--answers-file`: typed JSON answers, read while the command line is parsed."""
    if path is None:
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        # ValueError: not JSON, not UTF-8, or an int past Python's 4 300-digit limit (which
        # `json` raises outside JSONDecodeError); RecursionError: nested too deeply.
        raise click.BadParameter(str(exc)[:200], ctx=ctx, param=param) from exc
    if not isinstance(loaded, dict):
        raise click.BadParameter("must hold a JSON object", ctx=ctx, param=param)
    return loaded


def budget_overrides(
    max_duration: timedelta | None, max_cost_usd: float | None, max_iterations: int | None
) -> Budget | None:
    if max_duration is None and max_cost_usd is None and max_iterations is None:
        return None
    duration = max_duration.total_seconds() if max_duration is not None else None
    return Budget(max_duration=duration, max_cost_usd=max_cost_usd, max_iterations=max_iterations)


def progress_printer(enabled: bool) -> Callable[[Event], None] | None:
    if not enabled:
        return None

    def show(event: Event) -> None:
        click.echo(event_line(event), err=True)

    return show
