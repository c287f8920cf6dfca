"""`runfleet`: the operator CLI (SPEC §10). Every command takes `--json`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click

from engine.loader import load_workflow_file
from engine.local import LocalEnv, resume_local, run_local
from engine.resume import ResumeRequest
from engine.rewind import rewind
from publisher import WireNames, WireSettings, connect, ensure_streams
from runner.cli.context import open_env
from runner.cli.dlq import dlq_group
from runner.cli.runtime import command, json_option
from runner.cli.views import echo_json, echo_run, event_line, run_view
from store import Budget, Event, RunfleetError, RunQuery, RunStatus, utcnow
from store.timeutil import parse_duration

P = ParamSpec("P")
T = TypeVar("T")


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
    except (OSError, json.JSONDecodeError) as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    if not isinstance(loaded, dict):
        raise click.BadParameter("must hold a JSON object", ctx=ctx, param=param)
    return loaded


def budget_overrides(
    max_duration: str | None, max_cost_usd: float | None, max_iterations: int | None
) -> Budget | None:
    if max_duration is None and max_cost_usd is None and max_iterations is None:
        return None
    duration = None
    if max_duration is not None:
        try:
            duration = parse_duration(max_duration).total_seconds()
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--max-duration") from exc
    return Budget(max_duration=duration, max_cost_usd=max_cost_usd, max_iterations=max_iterations)


def runner_for_sweep(env: Any) -> Any:
    """A runner that does not consume: only its services, for a one-off sweep pass."""
    from runner.config import RunnerSettings
    from runner.runner import Runner

    return Runner(
        store=env.store,
        driver=env.driver(),
        data_dir=env.data_dir,
        blobs=env.blobs,
        settings=RunnerSettings(sweeper=False, backstop=False, slots=1, http_host="127.0.0.1"),
        engine=env.engine,
        wire=WireSettings(data=env.settings.data),
        consume=False,
    )


def progress_printer(enabled: bool) -> Callable[[Event], None] | None:
    if not enabled:
        return None

    def show(event: Event) -> None:
        click.echo(event_line(event), err=True)

    return show


@click.group()
@click.version_option(package_name="runfleet")
def cli() -> None:
    """runfleet: durable workflow runs on a fleet of runners fed by NATS JetStream.

    Settings come from RUNFLEET_* variables; RUNFLEET_DATA (default ./.runfleet) holds the
    embedded default's SQLite store and blobs.
    """


@cli.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--var", "vars_", multiple=True, metavar="K=V", help="set a workflow var")
@click.option("--quiet", is_flag=True, help="no node progress on stderr")
@json_option
@command
async def run_cmd(file: Path, vars_: tuple[str, ...], quiet: bool, as_json: bool) -> None:
    """Execute a workflow in this process (no queue), as a `local` run."""
    loaded = load_workflow_file(file)
    async with open_env() as env:
        local = LocalEnv(
            env.store,
            env.driver(),
            env.engine,
            env.data_dir,
            env.blobs,
            on_event=progress_printer(not quiet and not as_json),
        )
        doc = await run_local(
            local, loaded, parse_pairs(vars_, "--var"), tenant=env.settings.tenant
        )
    echo_json(run_view(doc)) if as_json else echo_run(doc)


@cli.command("resume")
@click.argument("run_id")
@click.option("--answer", "answers", multiple=True, metavar="K=V", help="answer a question")
@click.option(
    "--answers-file",
    "typed_answers",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    callback=read_answers_file,
    help="typed answers as a JSON object (flags win)",
)
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="accept a changed workflow source")
@click.option("--accept-scratch-loss", is_flag=True, help="continue without the banked scratch")
@click.option("--max-duration", metavar="D")
@click.option("--max-cost-usd", type=float)
@click.option("--max-iterations", type=int)
@click.option("--local", "local", is_flag=True, help="resume in this process, not the queue")
@click.option("--auto-resume", type=click.IntRange(min=0), default=0, metavar="N")
@click.option("--quiet", is_flag=True)
@json_option
@command
async def resume_cmd(
    run_id: str,
    answers: tuple[str, ...],
    typed_answers: dict[str, Any],
    file: Path | None,
    force: bool,
    accept_scratch_loss: bool,
    max_duration: str | None,
    max_cost_usd: float | None,
    max_iterations: int | None,
    local: bool,
    auto_resume: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Resume a paused, failed_resumable or cancelled run."""
    request = ResumeRequest(
        answers=typed_answers,
        cli_answers=parse_pairs(answers, "--answer"),
        answers_base_dir=Path.cwd(),
        force=force,
        accept_scratch_loss=accept_scratch_loss,
        budget=budget_overrides(max_duration, max_cost_usd, max_iterations),
        new_source=load_workflow_file(file) if file is not None else None,
    )
    async with open_env() as env:
        if not local:
            if auto_resume:
                raise click.UsageError("--auto-resume goes with --local")
            async with env.publisher() as publisher:
                doc = await publisher.resume(run_id, request, tenant=env.settings.tenant)
            echo_json(run_view(doc)) if as_json else echo_run(doc)
            return
        local_env = LocalEnv(
            env.store,
            env.driver(),
            env.engine,
            env.data_dir,
            env.blobs,
            on_event=progress_printer(not quiet and not as_json),
        )
        doc = await resume_local(local_env, run_id, request, auto_resume=auto_resume)
    echo_json(run_view(doc)) if as_json else echo_run(doc)


cli.add_command(dlq_group)


@cli.command("launch")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--var", "vars_", multiple=True, metavar="K=V", help="set a workflow var")
@json_option
@command
async def launch_cmd(file: Path, vars_: tuple[str, ...], as_json: bool) -> None:
    """Queue a new run of FILE for the fleet."""
    loaded = load_workflow_file(file)
    async with open_env() as env, env.publisher() as publisher:
        doc = await publisher.launch(
            loaded, parse_pairs(vars_, "--var"), tenant=env.settings.tenant
        )
    echo_json(run_view(doc)) if as_json else echo_run(doc)


@cli.command("cancel")
@click.argument("run_id")
@json_option
@command
async def cancel_cmd(run_id: str, as_json: bool) -> None:
    """Cancel a run (a running one is asked to stop, and checkpoints first)."""
    async with open_env() as env, env.publisher() as publisher:
        doc = await publisher.cancel(run_id, tenant=env.settings.tenant)
    echo_json(run_view(doc)) if as_json else echo_run(doc)


@cli.group("streams")
def streams_group() -> None:
    """JetStream streams and consumers."""


@streams_group.command("ensure")
@json_option
@command
async def streams_ensure_cmd(as_json: bool) -> None:
    """Create or update the streams and consumers of the wire contract (idempotent)."""
    wire = WireSettings()
    nc, js = await connect(wire, name="runfleet-streams")
    try:
        report = await ensure_streams(js, WireNames(wire.namespace), wire)
    finally:
        await nc.close()
    if as_json:
        echo_json({"created": report.created, "updated": report.updated})
    else:
        click.echo(f"created: {', '.join(report.created) or '-'}")
        click.echo(f"updated: {', '.join(report.updated) or '-'}")


@cli.command("up")
@click.option("--runners", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--slots", type=click.IntRange(1, 10_000), default=8, show_default=True)
@click.option("--data", type=click.Path(file_okay=False, path_type=Path), help="RUNFLEET_DATA")
@click.option("--no-view", is_flag=True, help="no live view (a status line every 10 s)")
@command
async def up_cmd(runners: int, slots: int, data: Path | None, no_view: bool) -> None:
    """Run the embedded fleet: local nats-server, SQLite store, N runner processes."""
    import os
    import signal

    from runner.cli.live import live_view
    from runner.embedded import EmbeddedFleet

    if data is not None:
        os.environ["RUNFLEET_DATA"] = str(data)
    async with open_env(data) as env:
        fleet = EmbeddedFleet(data=env.data_dir, runners=runners, slots=slots, store=env.store)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, fleet.request_stop)
        try:
            await fleet.start()
            click.echo(
                f"runfleet up: {runners} runners x {slots} slots, NATS {fleet.nats_url},"
                f" data {env.data_dir}\n  in another shell: runfleet launch examples/hello.yaml"
                "\n  Ctrl-C drains the runners and stops the fleet",
                err=True,
            )
            supervise = asyncio.ensure_future(fleet.supervise())
            view = asyncio.ensure_future(live_view(fleet, interactive=not no_view))
            await fleet.wait_stop_requested()
            view.cancel()
            click.echo("\nstopping: draining runners (in-flight runs are handed off)...", err=True)
        finally:
            grace = env.engine.unwind_ceiling.total_seconds() + 30
            await fleet.shutdown(grace)
        await supervise
        click.echo("fleet stopped", err=True)


@cli.command("runner")
@click.option("--slots", type=click.IntRange(1, 10_000), help="concurrent deliveries")
@click.option("--http-port", type=click.IntRange(0, 65535), help="health/metrics port")
@command
async def runner_cmd(slots: int | None, http_port: int | None) -> None:
    """Run one runner process until SIGTERM or Ctrl-C, then drain (hand off) and exit 0."""
    import signal

    from runner.config import RunnerSettings
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
            wire=WireSettings(data=env.settings.data),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(runner.shutdown()))
        await runner.start()
        assert runner.http is not None
        click.echo(
            f"runner {runner.owner}: {settings.slots} slots, http :{runner.http.port}", err=True
        )
        await runner.run()


@cli.command("sweep")
@json_option
@command
async def sweep_cmd(as_json: bool) -> None:
    """Run one orphan-sweeper pass now (SPEC §5.9)."""
    from runner.sweeper import Sweeper

    async with open_env() as env:
        runner = runner_for_sweep(env)
        async with runner:
            assert runner.svc is not None
            report = await Sweeper(runner.svc).sweep_once(force=True)
    if as_json:
        echo_json({"actions": dict(report.actions)})
    else:
        for action, count in sorted(report.actions.items()):
            click.echo(f"{action}: {count}")
        if not report.actions:
            click.echo("nothing to do")


@cli.command("status")
@click.argument("run_id")
@json_option
@command
async def status_cmd(run_id: str, as_json: bool) -> None:
    """Show one run."""
    async with open_env() as env:
        doc = await env.store.get_run(run_id)
    echo_json(run_view(doc)) if as_json else echo_run(doc)


@cli.command("runs")
@click.option(
    "--status", "statuses", multiple=True, type=click.Choice([s.value for s in RunStatus])
)
@click.option("--code", "codes", multiple=True, help="failure code")
@click.option("--since", metavar="D", help="created within this duration, e.g. 1h")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50)
@click.option("--after", metavar="RUN", help="page after this run id")
@json_option
@command
async def runs_cmd(
    statuses: tuple[str, ...],
    codes: tuple[str, ...],
    since: str | None,
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """List runs, oldest first, a page at a time."""

    created_since = utcnow() - parse_duration(since) if since else None
    async with open_env() as env:
        page = await env.store.list_runs(
            RunQuery(
                statuses=[RunStatus(s) for s in statuses],
                failure_codes=list(codes),
                created_since=created_since,
                tenant=env.settings.tenant,
                after_run_id=after,
                limit=limit,
            )
        )
    if as_json:
        echo_json({"runs": [run_view(r) for r in page.runs], "next_after": page.next_after})
        return
    click.echo(f"{'RUN':<38} {'WORKFLOW':<16} {'STATUS':<22} {'CODE':<22} ATTEMPT")
    for r in page.runs:
        code = r.failure_code or ""
        click.echo(
            f"{r.run_id:<38} {r.workflow.name[:16]:<16} {r.status:<22} {code:<22} {r.attempt}"
        )
    if page.next_after:
        click.echo(f"(more: --after {page.next_after})")


@cli.command("events")
@click.argument("run_id")
@click.option("--after", type=int, default=0, help="only events after this seq")
@click.option("--follow", "-f", is_flag=True, help="keep printing until the run stops moving")
@json_option
@command
async def events_cmd(run_id: str, after: int, follow: bool, as_json: bool) -> None:
    """Print a run's events (with --follow, as they happen)."""
    moving = {RunStatus.QUEUED, RunStatus.RUNNING}
    collected: list[Event] = []
    async with open_env() as env:
        await env.store.get_run(run_id)
        while True:
            events = await env.store.read_events(run_id, after_seq=after, limit=10_000)
            if events:
                after = events[-1].seq
                collected.extend(events)
                if not as_json:
                    for event in events:
                        click.echo(event_line(event))
            if not follow:
                break
            run = await env.store.get_run(run_id)
            if run.status not in moving and not events:
                break  # settled, and nothing new since the last read
            await asyncio.sleep(0.5)
    if as_json:
        echo_json({"events": [e.model_dump(mode="json") for e in collected]})


@cli.command("gc")
@click.option("--older-than", required=True, metavar="D", help="e.g. 30d")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@json_option
@command
async def gc_cmd(older_than: str, yes: bool, as_json: bool) -> None:
    """Delete settled runs (finished, failed, cancelled) not updated for D, with their events
    and blobs; DLQ records and staged uploads older than D."""
    from store.staging import StagingStore

    age = parse_duration(older_than)
    cutoff = utcnow() - age
    settled = [RunStatus.FINISHED, RunStatus.FAILED, RunStatus.CANCELLED]
    async with open_env() as env:
        victims: list[str] = []
        after: str | None = None
        while True:
            page = await env.store.list_runs(
                RunQuery(statuses=settled, updated_before=cutoff, after_run_id=after, limit=500)
            )
            victims.extend(r.run_id for r in page.runs)
            if page.next_after is None:
                break
            after = page.next_after
        if (
            victims
            and not yes
            and not as_json
            and not click.confirm(
                f"delete {len(victims)} run(s) older than {older_than}?", err=True
            )
        ):
            raise click.Abort()
        for run_id in victims:
            for blob in await env.blobs.list(f"runs/{run_id}/"):
                await env.blobs.delete(blob.key)
            await env.store.delete_run(run_id)
        uploads = await StagingStore(env.store, env.blobs).reap(age, utcnow())
        dlq_removed = 0
        try:
            async with env.publisher() as pub:
                assert pub.dlq is not None
                for record in await pub.dlq.list(older_than=cutoff):
                    dlq_removed += int(await pub.dlq.delete(record.id))
        except RunfleetError as exc:
            click.echo(f"DLQ not collected: {exc.message}", err=True)
    report = {"runs": len(victims), "staged_uploads": uploads, "dlq_records": dlq_removed}
    if as_json:
        echo_json(report)
    else:
        click.echo(", ".join(f"{k}: {v}" for k, v in report.items()))


@cli.command("rewind")
@click.argument("run_id")
@click.option("--node", required=True, help="the node to rewind to")
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@command
async def rewind_cmd(run_id: str, node: str, file: Path | None, as_json: bool) -> None:
    """Move a run's checkpoint back to NODE and park it paused_operator."""
    new_source = load_workflow_file(file) if file is not None else None
    async with open_env() as env:
        result = await rewind(
            env.store,
            run_id,
            node,
            new_source=new_source,
            skew_s=env.engine.lease_skew.total_seconds(),
        )
    if as_json:
        echo_json({**run_view(result.run), "dropped_nodes": result.dropped})
    else:
        echo_run(result.run)
        click.echo(f"dropped: {', '.join(result.dropped) or 'nothing'}")
