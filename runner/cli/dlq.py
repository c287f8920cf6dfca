"""`runfleet dlq …`: list, show, replay and purge dead-letter records (SPEC §10).

A bulk replay goes record by record, each through the publisher's replay (a fresh attempt; the
record removed only once the replay is published), so a crash half-way loses nothing and a
re-run finishes the job: records already replayed are recognised and removed, never replayed
twice.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import click

from publisher import DlqRecord, DlqStore, decode
from publisher.errors import MalformedMessage, UnsupportedSchema
from publisher.nats_errors import nats_boundary
from runner.cli.context import open_env
from runner.cli.errors import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, exit_code_for
from runner.cli.runtime import command, echo_json, json_option
from store import RunfleetError, RunNotFound, utcnow
from store.timeutil import parse_duration


def record_view(record: DlqRecord) -> dict[str, Any]:
    out = record.model_dump(mode="json", exclude={"body_b64"})
    out["age_s"] = round((utcnow() - record.at).total_seconds(), 1)
    return out


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@click.group("dlq")
def dlq_group() -> None:
    """Dead-letter records: what the fleet could not process, kept for an operator."""


async def _select(
    dlq: DlqStore, ids: tuple[int, ...], all_: bool, reason: str | None, older_than: str | None
) -> list[DlqRecord]:
    if ids and all_:
        raise click.UsageError("give record ids or --all, not both")
    if not ids and not all_:
        raise click.UsageError("give record ids or --all")
    cutoff = utcnow() - parse_duration(older_than) if older_than else None
    if all_:
        return await dlq.list(reason=reason, older_than=cutoff)
    return [await dlq.get(i) for i in ids]


@dlq_group.command("list")
@click.option("--reason", help="only records with this reason")
@click.option("--older-than", metavar="D", help="only records older than D (e.g. 1h)")
@json_option
@command
async def dlq_list(reason: str | None, older_than: str | None, as_json: bool) -> None:
    """List DLQ records (id = the work-stream sequence of the dead message)."""
    cutoff = utcnow() - parse_duration(older_than) if older_than else None
    async with open_env() as env, env.publisher() as pub:
        assert pub.dlq is not None
        records = await pub.dlq.list(reason=reason, older_than=cutoff)
    if as_json:
        echo_json({"records": [record_view(r) for r in records]})
        return
    click.echo(f"{'ID':>8} {'RUN':<38} {'ATT':>3} {'REASON':<20} {'DELIV':>5} AGE")
    for r in records:
        click.echo(
            f"{r.id:>8} {r.run_id or '-':<38} {r.attempt or '-':>3} {r.reason:<20}"
            f" {r.num_delivered:>5} {_age((utcnow() - r.at).total_seconds())}"
        )
    click.echo(f"{len(records)} record(s)")


@dlq_group.command("show")
@click.argument("record_id", type=int)
@json_option
@command
async def dlq_show(record_id: int, as_json: bool) -> None:
    """Show one record, its decoded body where decodable, and its run's status."""
    async with open_env() as env, env.publisher() as pub:
        assert pub.dlq is not None
        record = await pub.dlq.get(record_id)
        body = await pub.dlq.body(record)
        decoded: Any
        try:
            decoded = decode(body, record.headers).model_dump(mode="json")
        except (MalformedMessage, UnsupportedSchema) as exc:
            decoded = {
                "undecodable": exc.message,
                "raw_b64": base64.b64encode(body[:4096]).decode(),
            }
        run_status = None
        if record.run_id:
            try:
                run = await env.store.get_run(record.run_id)
                run_status = {
                    "status": str(run.status),
                    "attempt": run.attempt,
                    "failure_code": run.failure_code,
                }
            except RunNotFound:
                run_status = {"status": "not_found"}
    view = {**record_view(record), "body": decoded, "run": run_status}
    if as_json:
        echo_json(view)
    else:
        click.echo(json.dumps(view, indent=2, default=str))


@dlq_group.command("replay")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "all_", is_flag=True, help="every record (with --reason, those only)")
@click.option("--reason")
@json_option
@command
async def dlq_replay(ids: tuple[int, ...], all_: bool, reason: str | None, as_json: bool) -> None:
    """Replay records as fresh attempts of their runs."""
    results: list[dict[str, Any]] = []
    exit_code = EXIT_OK
    not_attempted: list[int] = []
    unreachable: set[int] = set()
    async with open_env() as env, env.publisher() as pub:
        assert pub.dlq is not None
        records = await _select(pub.dlq, ids, all_, reason, None)
        for index, record in enumerate(records):
            try:
                with nats_boundary(f"replaying DLQ record {record.id}"):
                    run = await pub.replay(record.id, tenant=env.settings.tenant)
                results.append(
                    {
                        "id": record.id,
                        "run_id": run.run_id,
                        "attempt": run.attempt,
                        "replayed": True,
                    }
                )
            except RunfleetError as exc:
                results.append({"id": record.id, "replayed": False, "error": exc.to_dict()})
                if exit_code_for(exc) == EXIT_UNREACHABLE:
                    # NATS or the store is not there: every other record would fail alike,
                    # each after its retry budget. They stay, for a replay once it is back.
                    exit_code = EXIT_UNREACHABLE
                    unreachable.add(record.id)
                    not_attempted = [r.id for r in records[index + 1 :]]
                    break
                exit_code = EXIT_REFUSED
    if as_json:
        out: dict[str, Any] = {"results": results}
        if not_attempted:
            out["not_attempted"] = not_attempted
        echo_json(out)
    else:
        for r in results:
            if r["replayed"]:
                click.echo(f"replayed {r['id']}: run {r['run_id']} attempt {r['attempt']}")
            elif r["id"] in unreachable:
                click.echo(f"failed   {r['id']}: [{r['error']['code']}] {r['error']['message']}")
                click.echo(f"  remedy: {r['error'].get('remedy')}")
            else:
                click.echo(f"refused  {r['id']}: [{r['error']['code']}] {r['error']['message']}")
        if not_attempted:
            click.echo(f"not attempted: {', '.join(map(str, not_attempted))}")
    if exit_code != EXIT_OK:
        raise SystemExit(exit_code)


@dlq_group.command("purge")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "all_", is_flag=True)
@click.option("--reason")
@click.option("--older-than", metavar="D")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@json_option
@command
async def dlq_purge(
    ids: tuple[int, ...],
    all_: bool,
    reason: str | None,
    older_than: str | None,
    yes: bool,
    as_json: bool,
) -> None:
    """Remove records for good (prints what it removed)."""
    async with open_env() as env, env.publisher() as pub:
        assert pub.dlq is not None
        records = await _select(pub.dlq, ids, all_, reason, older_than)
        if not records:
            echo_json({"removed": []}) if as_json else click.echo("nothing to purge")
            return
        if not yes:
            listing = ", ".join(str(r.id) for r in records[:20])
            more = f" and {len(records) - 20} more" if len(records) > 20 else ""
            if not click.confirm(f"purge {len(records)} record(s): {listing}{more}?", err=True):
                raise click.Abort()
        removed = [r.id for r in records if await pub.dlq.delete(r.id)]
    if as_json:
        echo_json({"removed": removed})
    else:
        for rid in removed:
            click.echo(f"removed {rid}")
