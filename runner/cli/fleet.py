"""Commands on the fleet: up, runner (processes, here), sweep, streams ensure, gc (through
`runner.operations`)."""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runner import operations as ops
from runner.cli.options import DURATION
from runner.cli.runtime import command, confirm_or_refuse, json_option
from runner.cli.views import echo_json
from runner.operations import open_env
from store.settings import format_duration

if TYPE_CHECKING:
    from runner.console.auth import TokenBook
    from runner.embedded import EmbeddedFleet, RunnerRow


@click.group("streams")
def streams_group() -> None:
    """JetStream streams and consumers.

    \b
    Example:
      runfleet streams ensure
    """


@streams_group.command("ensure")
@json_option
@command
async def streams_ensure_cmd(as_json: bool) -> None:
    """Create or update the streams and consumers of the wire contract (idempotent).

    \b
    Example:
      RUNFLEET_NATS_URL=nats://nats:4222 runfleet streams ensure
    """
    from publisher import WireNames
    from publisher.config import WireSettings

    report = await ops.ensure_wire()
    if as_json:
        echo_json({"created": report.created, "updated": report.updated, "changes": report.changes})
    else:
        click.echo(f"created: {', '.join(report.created) or '-'}")
        click.echo(f"updated: {', '.join(report.updated) or '-'}")
        for name, changes in report.changes.items():
            click.echo(f"  {name}: {', '.join(changes)}")
    names = WireNames(WireSettings().namespace)
    if f"{names.runs_stream}/{names.consumer}" in report.changes:
        click.echo(
            "note: runners check the consumer when they start (SPEC §3): one started with the"
            " old values refuses to start again (consumer_mismatch) until it runs with these",
            err=True,
        )


@click.command("up")
@click.option(
    "--runners", type=click.IntRange(1, 64), default=2, show_default=True, help="runner processes"
)
@click.option("--slots", type=click.IntRange(1, 10_000), help="per runner [RUNFLEET_SLOTS, 8]")
@click.option("--data", type=click.Path(file_okay=False, path_type=Path), help="RUNFLEET_DATA")
@click.option("--no-view", is_flag=True, help="no live view (the fleet's status every 10 s)")
@click.option(
    "--nats-cluster",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="local nats-servers in one JetStream cluster, streams replicated on each",
)
@click.option(
    "--api-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="the HTTP API's port on 127.0.0.1 (0: any free one); its URL is printed",
)
@command
async def up_cmd(
    runners: int,
    slots: int | None,
    data: Path | None,
    no_view: bool,
    nats_cluster: int,
    api_port: int,
) -> None:
    """Run the embedded fleet: local nats-server (or cluster), SQLite store, N runners.
    One fleet per data dir: a second `up` on it is refused (exit 3) while the first runs.

    \b
    Example:
      runfleet up --runners 4 --slots 16
    """
    from runner.config import RunnerSettings
    from runner.data_lock import hold_data_dir
    from store.config import StoreSettings

    slots = slots or RunnerSettings().slots
    if data is not None:
        os.environ["RUNFLEET_DATA"] = str(data)
    if nats_cluster > 1 and os.environ.get("RUNFLEET_NATS_URL"):
        raise click.UsageError("--nats-cluster starts local servers; unset RUNFLEET_NATS_URL")
    # Refused before anything starts: a fleet on this data dir (exit 3), then an API port
    # that cannot be bound (exit 2) — bound here and handed to the server, so it stays ours.
    with (
        hold_data_dir(StoreSettings().data.resolve()) as lock_fd,
        _api_socket(api_port) as api_sock,
    ):
        await _run_fleet(runners, slots, data, no_view, nats_cluster, api_sock, lock_fd)


def _api_socket(port: int) -> socket.socket:
    from runner.cli.console import bind_refused
    from runner.console.listening import BindFailed, listening_socket

    try:
        return listening_socket("127.0.0.1", port)
    except BindFailed as exc:
        raise bind_refused(exc, port_flag="--api-port") from exc


async def _run_fleet(
    runners: int,
    slots: int,
    data: Path | None,
    no_view: bool,
    nats_cluster: int,
    api_sock: socket.socket,
    lock_fd: int,
) -> None:
    """Start the fleet, serve its API on `api_sock`, show it, and on Ctrl-C (or SIGTERM)
    drain and stop it."""
    import signal

    from runner.cli.live import live_view
    from runner.console.auth import load_tokens
    from runner.embedded import EmbeddedFleet

    async with open_env(data) as env:
        _ = env.engine, env.wire()  # every setting the runners read, checked before any starts
        book = load_tokens(env.tenant)  # and the API's: a token file it cannot use is exit 2, as in
        # `runfleet console`, not a fleet that runs on without the API it was asked for
        _log_fleet_events(env.data_dir, to_stderr=no_view or not sys.stderr.isatty())
        fleet = EmbeddedFleet(
            data=env.data_dir,
            runners=runners,
            slots=slots,
            store=env.store,
            nats_cluster=nats_cluster,
            lock_fd=lock_fd,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, fleet.request_stop)
        try:
            await fleet.start()
            for note in fleet.warnings:
                click.echo(f"runfleet up: warning: {note}", err=True)
            for name, changes in (fleet.ensured.changes if fleet.ensured else {}).items():
                click.echo(f"runfleet up: updated {name}: {', '.join(changes)}", err=True)
            # Other commands find the fleet through RUNFLEET_DATA (default ./.runfleet, relative
            # to where they run): a shell elsewhere, or after `--data`, needs it said.
            here = env.data_dir.resolve() == (Path.cwd() / ".runfleet").resolve()
            find = "" if here else f"RUNFLEET_DATA={shlex.quote(str(env.data_dir.resolve()))} "
            click.echo(
                f"runfleet up: {runners} runners x {slots} slots, NATS {fleet.nats_url},"
                f" data {env.data_dir}\n  in another shell: {find}runfleet launch"
                " examples/hello.yaml"
                + ("" if not here else " (from this directory, or set RUNFLEET_DATA)")
                + "\n  Ctrl-C drains the runners and stops the fleet",
                err=True,
            )
            supervise = asyncio.ensure_future(fleet.supervise())
            urls: list[str] = []  # the console's URL, once it listens: shown in the live view
            api = asyncio.ensure_future(_serve_api(api_sock, fleet, urls, book))
            view = asyncio.ensure_future(live_view(fleet, interactive=not no_view, notes=urls))
            await fleet.wait_stop_requested()
            view.cancel()
            api.cancel()
            click.echo("\nstopping: draining runners (in-flight runs are handed off)...", err=True)
        finally:
            grace = env.engine.unwind_ceiling.total_seconds() + 30
            await fleet.shutdown(grace)
        await supervise
        click.echo("fleet stopped", err=True)


def _log_fleet_events(data: Path, *, to_stderr: bool) -> None:
    """What `up` itself has to say while the fleet runs (a runner or the nats-server died and
    was restarted, and why) goes to `DATA/logs/up.log`, with the time, and to stderr unless the
    live view redraws there. Found by an on-call walkthrough: these warnings were logged to no
    handler at all (a one-shot command quiets the library's last-resort output), so a
    SIGKILLed runner left only `(restarts 1)` behind."""
    (data / "logs").mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    handlers: list[logging.Handler] = [logging.FileHandler(data / "logs" / "up.log")]
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    # The API server's own warnings too: a token file that no longer reads (its tokens read
    # before stay) was logged to no handler (a security walkthrough).
    for name in ("runner.embedded", "runner.console"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        for handler in handlers:
            handler.setFormatter(fmt)
            logger.addHandler(handler)


async def _serve_api(
    sock: socket.socket, fleet: EmbeddedFleet, urls: list[str], book: TokenBook
) -> None:
    """The HTTP API and the console beside the embedded fleet (SPEC v2.2 §10, §10b, §10c), on
    `sock` (127.0.0.1, bound before the fleet started). It finds the fleet as every other
    command does (`RUNFLEET_DATA/nats.url`); without a token the API refuses every request and
    the console is read-only, and it says how to give one. The console's URL goes into `urls`
    (the live view shows it); its fleet page reads the runner processes' rows from `fleet`. A
    failure to serve never stops the fleet."""
    import aiohttp

    from runner.console import serve
    from runner.heap import freeze_startup_heap

    # What the tokens allow (found by a walkthrough: an operate token from RUNFLEET_API_TOKENS
    # was said to leave the console read-only, because only RUNFLEET_CONSOLE_TOKEN was looked at).
    roles = {who.role for who in book.by_digest.values()}
    hint = "" if roles else " (no token: set RUNFLEET_CONSOLE_TOKEN or RUNFLEET_API_TOKENS)"
    ro = "" if "operate" in roles else " (read-only: no operate token)"

    def started(url: str) -> None:
        click.echo(f"  HTTP API on {url}/api/v1{hint}", err=True)
        urls.append(f"  console on {url}/ui/{ro}")
        click.echo(urls[-1], err=True)
        freeze_startup_heap()  # the API's launches wait out no full collection (ADR-0016)

    async def runner_rows() -> list[RunnerRow]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            rows = (await fleet.snapshot(session))["runners"]
        assert isinstance(rows, list)
        return rows

    try:
        port = int(sock.getsockname()[1])
        await serve("127.0.0.1", port, started=started, runners=runner_rows, sock=sock)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the fleet runs on without its API
        sock.close()  # a bound port no one serves would hold each client until it times out
        click.echo(f"  HTTP API not served: {exc}", err=True)


@click.command("runner")
@click.option("--slots", type=click.IntRange(1, 10_000), help="concurrent deliveries")
@click.option("--http-port", type=click.IntRange(0, 65535), help="health/metrics port")
@command
async def runner_cmd(slots: int | None, http_port: int | None) -> None:
    """Run one runner process until SIGTERM or Ctrl-C, then drain (hand off) and exit 0.

    \b
    Example:
      runfleet runner --slots 8 --http-port 9100
    """
    import signal

    from runner.config import RunnerSettings
    from runner.heap import freeze_startup_heap
    from runner.runner import Runner

    overrides: dict[str, Any] = {}
    if slots is not None:
        overrides["slots"] = slots
    if http_port is not None:
        overrides["http_port"] = http_port
    settings = RunnerSettings(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    async with open_env() as env:
        runner = Runner(
            store=env.store,
            driver=env.driver(),
            data_dir=env.data_dir,
            blobs=env.blobs,
            settings=settings,
            engine=env.engine,
            wire=env.wire(),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(runner.shutdown()))
        await runner.start()
        frozen = freeze_startup_heap()
        logging.getLogger(__name__).debug("runner: %d start-up objects frozen (gc)", frozen)
        await runner.run()


@click.command("sweep")
@json_option
@command
async def sweep_cmd(as_json: bool) -> None:
    """Run one orphan-sweeper pass now (SPEC §5.9).

    \b
    Example:
      runfleet sweep --json
    """
    async with open_env(create_store=False) as env:
        report = await ops.sweep(env)
    if as_json:
        echo_json({"actions": dict(report.actions)})
    else:
        for action, count in sorted(report.actions.items()):
            click.echo(f"{action}: {count}")
        if not report.actions:
            click.echo("nothing to do")


@click.command("gc")
@click.option("--older-than", required=True, type=DURATION, help="age to collect, e.g. 30d")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@json_option
@command
async def gc_cmd(older_than: timedelta, yes: bool, as_json: bool) -> None:
    """Delete settled runs (finished, failed, cancelled) not updated for D, with their events
    and blobs; DLQ records and staged uploads older than D. A DLQ record whose run still waits
    on it (parked failed_resumable) is kept, whatever its age.

    \b
    Example:
      runfleet gc --older-than 30d --yes
    """
    age = older_than
    async with open_env(create_store=False) as env:
        plan = await ops.plan_gc(env, age)
        if (plan.run_ids or plan.dlq_ids) and not yes:
            what = [f"{len(plan.run_ids)} run(s)"] if plan.run_ids else []
            what += [f"{len(plan.dlq_ids)} DLQ record(s)"] if plan.dlq_ids else []
            confirm_or_refuse(
                f"delete {' and '.join(what)} older than {format_duration(older_than)}?",
                nothing_done="nothing deleted",
            )
        collected = await ops.collect_garbage(env, plan)
        if collected.dlq_error is not None:
            click.echo(f"DLQ not collected: {collected.dlq_error.message}", err=True)
        if collected.dlq_kept and not as_json:
            click.echo(
                f"kept {collected.dlq_kept} DLQ record(s) as old whose runs still wait on them"
                " (`runfleet dlq list`: replay or purge them)",
                err=True,
            )
    report = {
        "runs": collected.runs,
        "staged_uploads": collected.staged_uploads,
        "dlq_records": collected.dlq_records,
        "dlq_records_kept": collected.dlq_kept,
    }
    if as_json:
        echo_json(report)
    else:
        click.echo(", ".join(f"{k}: {v}" for k, v in report.items()))
