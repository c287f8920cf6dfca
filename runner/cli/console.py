"""`runfleet console [--port P] [--host H]` (SPEC v2.2 §10, §10b, §10c): serve the HTTP API
(and the console that shares its server) until interrupted."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click

from runner.cli.runtime import command
from runner.console.listening import DEFAULT_HOST, DEFAULT_PORT, BindFailed
from runner.heap import freeze_startup_heap


def bind_refused(
    exc: BindFailed, *, port_flag: str, host_flag: str | None = None
) -> click.BadParameter:
    """A server that cannot listen was given a value it cannot use: a usage error (SPEC §10,
    exit 2) naming the flag as the user typed it, the value and why — not `internal`."""
    if exc.culprit == "host" and host_flag is not None:
        flag, value = host_flag, repr(exc.host)
        form = "an address of this machine (127.0.0.1; 0.0.0.0 for all interfaces)"
    else:
        flag, value, form = port_flag, str(exc.port), "a free port (0: any free one)"
    return click.BadParameter(
        f"{value}: {exc.reason}; give {form}",
        ctx=click.get_current_context(silent=True),
        param_hint=f"'{flag}'",
    )


@click.command("console")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="the port to listen on (0: any free one, announced on stderr)",
)
@click.option(
    "--host", default=DEFAULT_HOST, show_default=True, help="the interface to bind (0.0.0.0: all)"
)
@command
async def console_cmd(port: int, host: str) -> None:
    """Serve the HTTP API under /api/v1 (OpenAPI at /openapi.json) and the operator console
    under /ui/ (read-only until you log in with an operate token). Tokens come from
    RUNFLEET_API_TOKENS (a file: `TOKEN TENANT read|operate` a line) and
    RUNFLEET_CONSOLE_TOKEN (one operate token for RUNFLEET_TENANT).

    \b
    Example:
      RUNFLEET_CONSOLE_TOKEN=s3cret runfleet console --port 8470
    """

    def started(url: str) -> None:
        click.echo(f"runfleet API on {url}", err=True)
        click.echo(f"runfleet console on {url}/ui/", err=True)
        # Every launch or resume in flight would wait out each full collection over the
        # start-up heap (≈ 60 ms here): frozen once it is built, as a runner's is (ADR-0016).
        freeze_startup_heap()

    # What the server has to say (a token file that no longer reads, a request that failed)
    # goes to stderr, with the time: it was logged to no handler (a security walkthrough).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("runner.console")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    from runner.console import serve  # the server, only when serving (ADR-0024)

    serving = asyncio.ensure_future(serve(host, port, started=started))
    stopping: list[bool] = []

    def stop() -> None:
        stopping.append(True)
        serving.cancel()

    # SIGTERM (a pod stopped, a rollout) closes the listener and lets open requests finish for
    # up to the server's SHUTDOWN_S before exiting 0; its default action would cut them off.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    try:
        await serving
    except asyncio.CancelledError:
        if not stopping:
            raise
    except BindFailed as exc:
        raise bind_refused(exc, port_flag="--port", host_flag="--host") from exc
