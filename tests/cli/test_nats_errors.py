"""NATS errors the CLI meets become typed errors with remedies (SPEC §10, issue 12 item 3): a
missing stream and a JetStream that does not answer exit 4 naming what to do; no nats-py
exception type reaches the user as `error [internal]`.

The translation is a table (`publisher.nats_errors`); these tests hold every nats-py error type
to it, and run the CLI's own command wrapper (no subprocess: click's runner) on each. The real
conditions (a deleted stream, a server without JetStream) are in
tests/publisher/test_cli_publisher.py.
"""

from __future__ import annotations

import inspect
import json

import click
import nats.errors
import nats.js.errors
import pytest
from click.testing import CliRunner

from publisher.nats_errors import (
    JS_CONSUMER_NOT_FOUND,
    JS_NO_MESSAGE_FOUND,
    JS_STREAM_NOT_FOUND,
    translate_nats_error,
)
from runner.cli.errors import EXIT_OTHER, EXIT_UNREACHABLE, exit_code_for
from runner.cli.runtime import command, json_option


def every_nats_error_type() -> list[type[Exception]]:
    seen: list[type[Exception]] = []
    todo: list[type[Exception]] = [nats.errors.Error]
    while todo:
        kind = todo.pop()
        if kind not in seen:
            seen.append(kind)
            todo.extend(kind.__subclasses__())
    return sorted(seen, key=lambda k: f"{k.__module__}.{k.__qualname__}")


def instance(kind: type[Exception]) -> Exception:
    try:
        if issubclass(kind, nats.js.errors.APIError):
            return kind(code=500, description="boom")
        return kind()
    except TypeError:  # an __init__ with required arguments (e.g. a slow consumer's sid)
        required = [
            name
            for name, param in inspect.signature(kind).parameters.items()
            if param.default is inspect.Parameter.empty
            and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        ]
        return kind(**dict.fromkeys(required))


CASES = [
    (nats.js.errors.NoStreamResponseError(), "stream_not_found", EXIT_UNREACHABLE),
    (
        nats.js.errors.NotFoundError(code=404, err_code=JS_STREAM_NOT_FOUND),
        "stream_not_found",
        EXIT_UNREACHABLE,
    ),
    (
        nats.js.errors.NotFoundError(code=404, err_code=JS_CONSUMER_NOT_FOUND),
        "stream_not_found",
        EXIT_UNREACHABLE,
    ),
    (
        nats.js.errors.NotFoundError(code=404, err_code=JS_NO_MESSAGE_FOUND),
        "nats_request_failed",
        EXIT_OTHER,
    ),
    (nats.js.errors.ServiceUnavailableError(code=503), "jetstream_unavailable", EXIT_UNREACHABLE),
    (nats.errors.NoRespondersError(), "jetstream_unavailable", EXIT_UNREACHABLE),
    (nats.errors.TimeoutError(), "nats_timeout", EXIT_UNREACHABLE),
    (TimeoutError(), "nats_timeout", EXIT_UNREACHABLE),
    (nats.errors.ConnectionClosedError(), "nats_unavailable", EXIT_UNREACHABLE),
    (nats.errors.ConnectionReconnectingError(), "nats_unavailable", EXIT_UNREACHABLE),
    (nats.errors.NoServersError(), "nats_unavailable", EXIT_UNREACHABLE),
    (nats.js.errors.BadRequestError(code=400, description="bad"), "nats_request_failed", 1),
]


@pytest.mark.parametrize(("error", "code", "exit_code"), CASES, ids=lambda v: repr(v)[:40])
def test_a_nats_error_maps_to_its_typed_error_and_exit_code(
    error: Exception, code: str, exit_code: int
) -> None:
    typed = translate_nats_error(error)
    assert (typed.code, exit_code_for(typed)) == (code, exit_code)
    assert typed.remedy


def test_a_missing_stream_names_runfleet_streams_ensure() -> None:
    for error in (
        nats.js.errors.NoStreamResponseError(),
        nats.js.errors.NotFoundError(code=404, err_code=JS_STREAM_NOT_FOUND),
    ):
        assert "runfleet streams ensure" in (translate_nats_error(error).remedy or "")


def raising(error: BaseException) -> click.Command:
    @click.command()
    @json_option
    @command
    async def cmd(as_json: bool) -> None:
        raise error

    return cmd


@pytest.mark.parametrize("kind", every_nats_error_type(), ids=lambda k: k.__qualname__)
def test_no_nats_exception_type_reaches_the_user_as_internal(kind: type[Exception]) -> None:
    error = instance(kind)
    plain = CliRunner().invoke(raising(error), [])
    assert "internal" not in plain.output, plain.output
    assert "remedy:" in plain.output
    assert plain.exit_code in (EXIT_OTHER, EXIT_UNREACHABLE)

    as_json = CliRunner().invoke(raising(error), ["--json"])
    shown = json.loads(as_json.stdout)["error"]
    assert shown["code"] != "internal"
    assert shown["remedy"]
    assert as_json.exit_code == exit_code_for(translate_nats_error(error))
