"""Exit codes and error output of SPEC §10: 0 ok, 2 usage, 3 refused, 4 infrastructure
unreachable, 5 `run` ended failed/failed_resumable/cancelled (v2.2), 1 anything else. Errors
print the code, the cause and the remedy; with `--json` they print
`{"error": {"code", "message", "remedy", "also_needs_force"?}}` on stdout."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import click

from runner.operations.errors import is_refusal, is_unreachable, is_usage
from store import RunfleetError

EXIT_OK = 0
EXIT_OTHER = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
EXIT_RUN_FAILED = 5
"""`runfleet run`: the run ended `failed`, `failed_resumable` or `cancelled` (a CI gate)."""


def exit_code_for(exc: RunfleetError) -> int:
    """The operations' classification (`runner.operations.errors`), as an exit code."""
    if is_usage(exc):
        return EXIT_USAGE
    if is_refusal(exc):
        return EXIT_REFUSED
    if is_unreachable(exc):
        return EXIT_UNREACHABLE
    return EXIT_OTHER


def fail(exc: RunfleetError, *, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": exc.to_dict()}))
    else:
        click.echo(f"error [{exc.code}]: {exc.message}", err=True)
        if exc.remedy:
            click.echo(f"  remedy: {exc.remedy}", err=True)
    sys.exit(exit_code_for(exc))
