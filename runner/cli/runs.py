"""Commands on runs: run, launch, resume, cancel, status, runs, events, rewind. Each parses
its flags, calls `runner.operations` and prints."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from engine.failures import FailureCode
from engine.resume import ResumeRequest
from runner import operations as ops
from runner.cli.errors import EXIT_RUN_FAILED
from runner.cli.options import (
    DURATION,
    USD,
    budget_overrides,
    parse_pairs,
    progress_printer,
    read_answers_file,
)
from runner.cli.runtime import command, json_option
from runner.cli.tables import runs_table, shown
from runner.cli.uploads import parse_attach
from runner.cli.views import cancel_line, echo_json, echo_run, event_line, run_view
from runner.operations import open_env
from runner.operations.retry_wait import waiting_retry
from store import Event, RunDocument, RunfleetError, RunNotFound, RunStatus, utcnow
from store.codec import INVALID_REMEDY

if TYPE_CHECKING:
    from engine.loader import LoadedWorkflow
    from engine.local import LocalInterrupt

RUN_FAILED = frozenset({RunStatus.FAILED, RunStatus.FAILED_RESUMABLE, RunStatus.CANCELLED})
"""How `runfleet run` can end that a CI job must see as a failure (exit 5, SPEC §10 v2.2), and
`resume --local` alike: it ran the run in this process too, so a script reads both the same
way (a Ctrl-C's `cancelled` included)."""


def load_workflow(file: Path) -> LoadedWorkflow:
    """`engine.loader`, imported by the commands that read a workflow: `runs`, `status` and
    `events` start without the templates and sandbox settings it brings (ADR-0024)."""
    from engine.loader import load_workflow_file

    return load_workflow_file(file)


@contextlib.contextmanager
def stop_on_ctrl_c() -> Iterator[LocalInterrupt]:
    """The first Ctrl-C stops the in-process execution as an operator cancel would (it
    checkpoints, ends `cancelled`, releases its lease); the second is Python's own again,
    which aborts at once (asyncio cancels the command: exit 130, the lease left to lapse)."""
    from engine.local import LocalInterrupt  # the engine, only where a command runs one

    interrupt = LocalInterrupt()
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGINT)

    def restore() -> None:
        if loop.remove_signal_handler(signal.SIGINT):
            signal.signal(signal.SIGINT, previous)

    def first() -> None:
        restore()
        click.echo("interrupted: the run checkpoints and stops (Ctrl-C again aborts)", err=True)
        interrupt.request()

    loop.add_signal_handler(signal.SIGINT, first)
    try:
        yield interrupt
    finally:
        restore()


def echo_interrupted(doc: RunDocument, interrupt: LocalInterrupt, *, as_json: bool) -> bool:
    """Say how to continue a run a Ctrl-C stopped; whether it did stop it (the run may have
    reached its outcome first)."""
    if not interrupt.requested or doc.status is not RunStatus.CANCELLED:
        return False
    click.echo(f"interrupted: continue with `runfleet resume {doc.run_id} --local`", err=as_json)
    return True


ATTACH_OPTION = click.option(
    "--attach",
    "attach",
    multiple=True,
    metavar="NAME=PATH|NAME=upload:ID",
    help="give the run a file (SPEC §8)",
)


@click.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--var", "vars_", multiple=True, metavar="K=V", help="set a workflow var")
@ATTACH_OPTION
@click.option("--quiet", is_flag=True, help="no node progress on stderr")
@json_option
@command
async def run_cmd(
    file: Path, vars_: tuple[str, ...], attach: tuple[str, ...], quiet: bool, as_json: bool
) -> None:
    """Execute a workflow in this process (no queue), as a `local` run. Exits 0 when the run
    ends finished or paused, 5 when it ends failed, failed_resumable or cancelled.

    \b
    Example:
      runfleet run examples/hello.yaml --var name=Ada
      runfleet run review.yaml --attach spec=./spec.pdf
    """
    loaded = load_workflow(file)
    paths, uploads = parse_attach(attach)
    async with open_env() as env:
        with stop_on_ctrl_c() as interrupt:
            doc = await ops.run_local(
                env,
                loaded,
                parse_pairs(vars_, "--var"),
                on_event=progress_printer(not quiet and not as_json),
                interrupt=interrupt,
                attach_paths=paths,
                attach_uploads=uploads,
            )
    echo_json(run_view(doc)) if as_json else echo_run(doc)
    echo_interrupted(doc, interrupt, as_json=as_json)
    if doc.status in RUN_FAILED:  # a Ctrl-C's `cancelled` too: the run did not get done
        raise SystemExit(EXIT_RUN_FAILED)


@click.command("resume")
@click.argument("run_id")
@click.option("--answer", "answers", multiple=True, metavar="K=V", help="answer a question")
@click.option(
    "--answers-file",
    "typed_answers",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    callback=read_answers_file,
    help="typed answers as a JSON object (flags win)",
)
@click.option(
    "--file",
    "file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="a new workflow source for the run (with --force when it differs)",
)
@click.option("--force", is_flag=True, help="accept a changed workflow source")
@click.option("--accept-scratch-loss", is_flag=True, help="continue without the banked scratch")
@click.option("--max-duration", type=DURATION, help="raise the run's duration cap, e.g. 2h")
@click.option("--max-cost-usd", type=USD, help="raise the run's cost cap, in USD")
@click.option(
    "--max-iterations",
    type=click.IntRange(min=1),
    help="raise the run's cap on node executions",
)
@click.option("--local", "local", is_flag=True, help="resume in this process, not the queue")
@click.option(
    "--auto-resume",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="with --local: re-claim up to N times after an auto-resumable failure",
)
@click.option("--quiet", is_flag=True, help="no node progress on stderr")
@json_option
@command
async def resume_cmd(
    run_id: str,
    answers: tuple[str, ...],
    typed_answers: dict[str, Any],
    file: Path | None,
    force: bool,
    accept_scratch_loss: bool,
    max_duration: timedelta | None,
    max_cost_usd: float | None,
    max_iterations: int | None,
    local: bool,
    auto_resume: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Resume a paused, failed_resumable or cancelled run (RUN: its id or a unique prefix of 6+
    characters).

    \b
    Example:
      runfleet resume 01a2321e-d5 --answer approved=yes
      runfleet resume 01a2321e-d5 --local --max-iterations 20
    """
    request = ResumeRequest(
        answers=typed_answers,
        cli_answers=parse_pairs(answers, "--answer"),
        answers_base_dir=Path.cwd(),
        force=force,
        accept_scratch_loss=accept_scratch_loss,
        budget=budget_overrides(max_duration, max_cost_usd, max_iterations),
        new_source=load_workflow(file) if file is not None else None,
    )
    interrupt: LocalInterrupt | None = None
    async with open_env(create_store=False) as env:
        if not local:
            if auto_resume:
                raise click.UsageError("--auto-resume goes with --local")
            doc = await ops.resume(env, run_id, request)
        else:
            with stop_on_ctrl_c() as interrupt:
                doc = await ops.resume_local(
                    env,
                    run_id,
                    request,
                    auto_resume=auto_resume,
                    on_event=progress_printer(not quiet and not as_json),
                    interrupt=interrupt,
                )
    # Through the queue, say what was queued even when a runner already took the run (the
    # document is read after the publish); a local resume ran it, so it says how it ended.
    queued = not local
    echo_json(run_view(doc, just_queued=queued)) if as_json else echo_run(doc, just_queued=queued)
    if interrupt is not None:
        echo_interrupted(doc, interrupt, as_json=as_json)
    if local and doc.status in RUN_FAILED:
        raise SystemExit(EXIT_RUN_FAILED)


@click.command("launch")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--var", "vars_", multiple=True, metavar="K=V", help="set a workflow var")
@ATTACH_OPTION
@json_option
@command
async def launch_cmd(
    file: Path, vars_: tuple[str, ...], attach: tuple[str, ...], as_json: bool
) -> None:
    """Queue a new run of FILE for the fleet.

    \b
    Example:
      runfleet launch examples/hello.yaml --var name=Ada
      runfleet launch review.yaml --attach spec=./spec.pdf
    """
    loaded = load_workflow(file)
    inputs = parse_pairs(vars_, "--var")
    paths, uploads = parse_attach(attach)
    async with open_env() as env:
        doc = await ops.launch(env, loaded, inputs, attach_paths=paths, attach_uploads=uploads)
    echo_json(run_view(doc)) if as_json else echo_run(doc)


@click.command("cancel")
@click.argument("run_id")
@json_option
@command
async def cancel_cmd(run_id: str, as_json: bool) -> None:
    """Cancel a run (a running one is asked to stop, and checkpoints first).

    \b
    Example:
      runfleet cancel 01a2321e-d5
    """
    async with open_env(create_store=False) as env:
        doc = await ops.cancel(env, run_id)
    if as_json:
        echo_json(run_view(doc))  # `cancel_requested: true` says the same to a program
        return
    echo_run(doc)
    click.echo(cancel_line(doc))


@click.command("status")
@click.argument("run_id")
@json_option
@command
async def status_cmd(run_id: str, as_json: bool) -> None:
    """Show one run (RUN: its id or a unique prefix of 6+ characters).

    \b
    Example:
      runfleet status 01a2321e-d5
    """
    async with open_env(create_store=False) as env:
        try:
            doc = await ops.get_run(env, run_id)
        except RunNotFound as exc:
            if not env.store_made:
                raise
            raise RunNotFound(exc.message, remedy=fresh_store_note(env.settings.data)) from None
        retry = await waiting_retry(env, doc)
        parked = await ops.parked_record_id(env, doc)
    if as_json:
        echo_json({**run_view(doc, retry), "dlq_record": parked})
    else:
        echo_run(doc, retry, dlq_record=parked)


def fresh_store_note(data: Path) -> str:
    """What to say when a read made the embedded default's store just now."""
    return (
        f"no run was ever stored under {data.resolve()} (its store was made just now): run this"
        " from the directory `runfleet up` runs in, or set RUNFLEET_DATA to its data dir"
        " (`./dev up` keeps it in the repository's .runfleet)"
    )


@click.command("runs")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice([s.value for s in RunStatus]),
    help="only runs in this status (repeatable)",
)
@click.option(
    "--code",
    "codes",
    multiple=True,
    type=click.Choice([c.value for c in FailureCode]),
    help="failure code (alone: runs standing on it now, not ones cancelled since)",
)
@click.option("--since", type=DURATION, help="created within this duration, e.g. 1h")
@click.option("--workflow", metavar="NAME", help="only runs of this workflow (its name:)")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="runs per page"
)
@click.option("--after", metavar="RUN", help="page after this run id (toward older runs)")
@json_option
@command
async def runs_cmd(
    statuses: tuple[str, ...],
    codes: tuple[str, ...],
    since: timedelta | None,
    workflow: str | None,
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, a page at a time.

    \b
    Example:
      runfleet runs --status failed_resumable --since 1h
      runfleet runs --workflow hello --limit 10
    """
    async with open_env(create_store=False) as env:
        page = await ops.list_runs(
            env,
            statuses=[RunStatus(s) for s in statuses],
            failure_codes=codes,
            created_within=since,
            workflow=workflow,
            after=after,
            limit=limit,
            newest_first=True,
        )
        if env.store_made:
            click.echo(fresh_store_note(env.settings.data), err=True)
    unreadable = [{"run_id": u.run_id, "error": u.error} for u in page.unreadable]
    if as_json:
        echo_json(
            {
                "runs": [run_view(r) for r in page.runs],
                "next_after": page.next_after,
                "unreadable": unreadable,
            }
        )
        return
    for line in runs_table(page.runs, utcnow()):
        click.echo(line)
    for bad in page.unreadable:  # named, never a reason to show no run at all
        click.echo(f"unreadable  {shown(bad.run_id)}: {shown(bad.error)}")
    if page.unreadable:
        click.echo(f"  remedy: {INVALID_REMEDY}")
    if page.next_after:
        click.echo(f"(more: --after {page.next_after})")


@click.command("events")
@click.argument("run_id")
@click.option("--after", type=int, default=0, help="only events after this seq")
@click.option("--follow", "-f", is_flag=True, help="keep printing until the run stops moving")
@click.option("--deliveries", is_flag=True, help="merge in what the broker did with each delivery")
@json_option
@command
async def events_cmd(
    run_id: str, after: int, follow: bool, deliveries: bool, as_json: bool
) -> None:
    """Print a run's events (with --follow, as they happen; with --deliveries, merged with its
    delivery log: claims, acks, nak delays, DLQ records, superseded and duplicate deliveries).

    \b
    Example:
      runfleet events 01a2321e-d5 --follow
    """
    if deliveries:
        try:
            await _timeline(run_id, after, follow, as_json)
            return
        except RunfleetError as exc:
            if not ops.is_unreachable(exc) or follow:
                raise
            # The delivery log lives on NATS; the events are in the store, which a stopped
            # fleet still serves: show those and say what is missing (an on-call walkthrough
            # found the whole history withheld for want of the log).
            click.echo(
                f"note: the delivery log is not shown: {exc.message}; the run's events follow",
                err=True,
            )
    collected: list[Event] = []
    async with open_env(create_store=False) as env:
        async for events in ops.event_batches(env, run_id, after=after, follow=follow):
            collected.extend(events)
            if not as_json:
                for event in events:
                    click.echo(event_line(event))
    if as_json:
        echo_json({"events": [e.model_dump(mode="json") for e in collected]})


async def _timeline(run_id: str, after: int, follow: bool, as_json: bool) -> None:
    """`events --deliveries` (SPEC v2.2 §10b): the run's events and delivery log, merged."""
    collected: list[ops.TimelineEntry] = []
    async with open_env(create_store=False) as env:
        async for batch in ops.timeline_batches(env, run_id, after=after, follow=follow):
            collected.extend(batch)
            if not as_json:
                for entry in batch:
                    click.echo(_timeline_line(entry))
    if as_json:
        echo_json({"events": [entry.as_json() for entry in collected]})


def _timeline_line(entry: ops.TimelineEntry) -> str:
    if entry.event is not None:
        return event_line(entry.event)
    d = entry.delivery
    assert d is not None
    extra = [f"seq={d.stream_seq}", f"attempt={d.attempt}"]
    if d.delay is not None:
        extra.append(f"delay={d.delay:g}s")
    if d.record_id is not None:
        extra.append(f"record={d.record_id}")
    extra.append(f"runner={d.runner}")
    what = f"{d.action} {d.reason}"
    return f"{d.at.strftime('%H:%M:%S')} d{d.num_delivered:<4} {what:<24} {' '.join(extra)}"


@click.command("rewind")
@click.argument("run_id")
@click.option("--node", required=True, help="the node to rewind to")
@click.option(
    "--file",
    "file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="a new workflow source, stored with the rewind",
)
@json_option
@command
async def rewind_cmd(run_id: str, node: str, file: Path | None, as_json: bool) -> None:
    """Move a run's checkpoint back to NODE and park it paused_operator (SPEC §6.7; not from
    finished or running).

    \b
    Example:
      runfleet rewind 01a2321e-d5 --node review
    """
    new_source = load_workflow(file) if file is not None else None
    async with open_env(create_store=False) as env:
        result = await ops.rewind(env, run_id, node, new_source=new_source)
    if as_json:
        echo_json({**run_view(result.run), "dropped_nodes": result.dropped})
    else:
        echo_run(result.run)
        click.echo(f"dropped: {', '.join(result.dropped) or 'nothing'}")
