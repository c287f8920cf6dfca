"""What every command shares: async execution, `--json`, and SPEC §10's errors and exit codes."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn, ParamSpec

import click

from runner.cli.errors import EXIT_OK, EXIT_OTHER, fail
from runner.cli.views import echo_json
from runner.operations.errors import NotConfirmed
from store import RunfleetError

P = ParamSpec("P")

__all__ = ["command", "confirm_or_refuse", "echo_json", "json_option"]

json_option = click.option("--json", "as_json", is_flag=True, help="print one JSON document")


def confirm_or_refuse(question: str, *, nothing_done: str) -> None:
    """Ask before a destructive step; a no, or no terminal to ask on (stdin closed), is the
    refusal `not_confirmed` (exit 3, `--json` error) saying `nothing_done` — not click's bare
    "Aborted!" with exit 1, which reads as a crash and names no way forward."""
    try:
        if click.confirm(question, err=True):
            return
    except click.Abort:
        click.echo(err=True)  # the prompt's line was left open
    raise NotConfirmed(f"not confirmed: {nothing_done}")


def quiet_library_logs() -> None:
    """A one-shot command reports through its typed errors: the warnings a library logs on
    its way there (nats-py's connection errors through our error callback, each reconnect
    attempt) must not reach the terminal first. Only Python's last-resort handler — used when
    nothing configured logging — is raised to CRITICAL; a process that configures logging
    (`runfleet runner`) keeps every record."""
    if logging.lastResort is not None:
        logging.lastResort.setLevel(logging.CRITICAL)


def end_quietly_on_closed_pipe() -> NoReturn:
    """`runfleet runs | head -2`: the reader left, which is not an error (SPEC §10 v2.2).
    stdout goes to /dev/null so the interpreter's final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(EXIT_OK)


def command(fn: Callable[P, Awaitable[None]]) -> Callable[P, None]:
    """Run an async command; translate runfleet errors into SPEC §10's output and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        as_json = bool(kwargs.get("as_json", False))
        quiet_library_logs()
        try:
            asyncio.run(fn(*args, **kwargs))  # type: ignore[arg-type]
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        except BrokenPipeError:
            end_quietly_on_closed_pipe()
        except RunfleetError as exc:
            fail(exc, as_json=as_json)
        except (click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the last line of defence prints, exit 1
            # Imported here, on the error path only: nats-py costs every command's start-up
            # ≈ 0.3 s (ADR-0024). The operations translate at their boundaries; this is the
            # last line for a NATS error that slipped past one: typed, never `internal`.
            from publisher.nats_errors import NATS_ERRORS, translate_nats_error

            if isinstance(exc, NATS_ERRORS):
                fail(translate_nats_error(exc), as_json=as_json)
            if as_json:
                click.echo(json.dumps({"error": {"code": "internal", "message": repr(exc)}}))
            else:
                click.echo(f"error [internal]: {exc!r}", err=True)
            sys.exit(EXIT_OTHER)

    return wrapper
