"""`runfleet dlq …`: list, show, replay and purge dead-letter records (SPEC §10). The operations
(and why a bulk replay is safe to kill and re-run) are in `runner.operations.dlq`; this module
parses, asks, and prints."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from typing import Any

import click

from publisher import DlqRecord
from publisher.errors import RecordNotFound
from publisher.replay import replay_refusal
from runner import operations as ops
from runner.cli.errors import EXIT_REFUSED, EXIT_UNREACHABLE
from runner.cli.options import DURATION
from runner.cli.runtime import command, confirm_or_refuse, echo_json, json_option
from runner.cli.tables import shown as shown_text
from runner.operations import RecordDetail, ReplayReport, open_env
from runner.operations.dlq import DLQ_REASONS
from store import utcnow


def record_view(record: DlqRecord) -> dict[str, Any]:
    out = record.model_dump(mode="json", exclude={"body_b64"})
    out["age_s"] = round((utcnow() - record.at).total_seconds(), 1)
    return out


def detail_view(detail: RecordDetail) -> dict[str, Any]:
    decoded: Any
    if detail.message is not None:
        decoded = detail.message.model_dump(mode="json")
    else:
        decoded = {
            "undecodable": detail.undecodable,
            "raw_b64": base64.b64encode(detail.body[:4096]).decode(),
        }
    run_status: dict[str, Any] | None = None
    if detail.run is not None:
        run_status = {
            "status": str(detail.run.status),
            "attempt": detail.run.attempt,
            "failure_code": detail.run.failure_code,
        }
    elif detail.run_missing:
        run_status = {"status": "not_found"}
    refusal = replay_refusal(detail.record, detail.run)
    return {
        **record_view(detail.record),
        "body": decoded,
        "run": run_status,
        # Whether a replay would go ahead now, judged as `dlq replay` judges it.
        "replay_refusal": None if refusal is None else refusal.to_dict(),
    }


BODY_PREVIEW = 120
"""Bytes of an undecodable body `dlq show` prints, escaped (`--json` has the first 4 KiB)."""


def detail_lines(view: dict[str, Any]) -> list[str]:
    """`dlq show` for a person: the record as a two-column table, then the decoded body."""
    run = view.get("run") or {}
    run_now = run.get("status", "-")
    if run.get("failure_code"):
        run_now += f" {run['failure_code']}"
    if run.get("attempt") is not None:
        run_now += f" (attempt {run['attempt']})"
    rows = [
        ("record", str(view["id"])),
        ("reason", view["reason"] + (f": {view['detail']}" if view.get("detail") else "")),
        ("run", f"{view.get('run_id') or '-'}  attempt {view.get('attempt') or '-'}"),
        ("run now", run_now if view.get("run_id") else "-"),
        ("delivered", f"{view['num_delivered']} time(s), last by {view.get('runner') or '-'}"),
        ("at", f"{view['at']}  ({_age(view['age_s'])} ago)"),
        ("replayable", _replayable(view)),
    ]
    body = view.get("body") or {}
    if "undecodable" in body:
        rows.append(("body", f"undecodable: {body['undecodable']}"))
        raw = base64.b64decode(body.get("raw_b64") or "")
        shown = raw[:BODY_PREVIEW].decode("utf-8", errors="backslashreplace")
        more = " …" if len(raw) > BODY_PREVIEW else ""
        rows.append(("body bytes", shown + more))  # escaped with every row below
    else:
        rows.extend((f"body.{k}", json.dumps(v, default=str)) for k, v in body.items())
    rows.extend((f"header {k}", v) for k, v in sorted((view.get("headers") or {}).items()))
    rows = [(shown_text(k, limit=80), shown_text(v)) for k, v in rows]
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _replayable(view: dict[str, Any]) -> str:
    refusal = view.get("replay_refusal")
    if not refusal:
        return "yes"
    return f"no: [{refusal['code']}] {refusal['message']} ({refusal.get('remedy') or 'purge it'})"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


REASON = click.Choice(DLQ_REASONS)
"""`--reason`: a reason the fleet writes. A mistyped one would match nothing and print an empty
list (or replay nothing) as if all were well; click refuses it naming the flag, the value and
the reasons accepted (exit 2)."""


def _ids_or_all(
    ids: tuple[int, ...], all_: bool, filters: dict[str, object] | None = None
) -> tuple[int, ...] | None:
    """The ids given, or None for `--all` (exactly one of the two). `filters` (flag → value)
    narrow `--all` only: ids name their records already, and a filter beside them used to be
    dropped without a word, so it is refused instead."""
    if ids and all_:
        raise click.UsageError("give record ids or --all, not both")
    if not ids and not all_:
        raise click.UsageError("give record ids or --all")
    given = [flag for flag, value in (filters or {}).items() if value is not None]
    if ids and given:
        verb = "goes" if len(given) == 1 else "go"
        raise click.UsageError(
            f"{' and '.join(given)} {verb} with --all, not with record ids"
            f" (drop {' and '.join(given)}, or use --all instead of the ids)"
        )
    return None if all_ else ids


def _not_this_tenants(record_id: int, tenant: str) -> RecordNotFound:
    """A record of another tenant, named to the CLI's operator as the API names it to a token
    of another tenant: not found, with how to act for its tenant."""
    return RecordNotFound(
        f"no DLQ record {record_id} for tenant {tenant}",
        remedy="list records with `runfleet dlq list`; a record belongs to its run's tenant:"
        " set RUNFLEET_TENANT to that tenant to act on it",
    )


@click.group("dlq")
def dlq_group() -> None:
    """Dead-letter records: what the fleet could not process, kept for an operator.

    \b
    Example:
      runfleet dlq list --reason retries_exhausted
    """


@dlq_group.command("list")
@click.option("--reason", type=REASON, help="only records with this reason")
@click.option("--older-than", type=DURATION, help="only records older than this, e.g. 1h")
@json_option
@command
async def dlq_list(reason: str | None, older_than: timedelta | None, as_json: bool) -> None:
    """List DLQ records (id = the work-stream sequence of the dead message).

    \b
    Example:
      runfleet dlq list --older-than 1h
    """
    age = older_than
    async with open_env(create_store=False) as env:
        every = await ops.list_records(env, reason=reason, older_than=age)
        records = await ops.records_of(env, every, env.tenant, env.tenant)
        tenant = env.tenant
    others = len(every) - len(records)
    if as_json:
        echo_json({"records": [record_view(r) for r in records], "other_tenants": others})
        return
    click.echo(f"{'ID':>8} {'RUN':<38} {'ATT':>3} {'REASON':<20} {'DELIV':>5} AGE")
    for r in records:
        click.echo(
            f"{r.id:>8} {shown_text(r.run_id or '-', limit=38):<38} {r.attempt or '-':>3}"
            f" {r.reason:<20}"
            f" {r.num_delivered:>5} {_age((utcnow() - r.at).total_seconds())}"
        )
    click.echo(f"{len(records)} record(s)")
    if others:
        # The CLI acts for RUNFLEET_TENANT, as the API acts for its token's tenant (found by a
        # walkthrough: `dlq list` showed every tenant's records, `dlq replay` acted for one).
        click.echo(
            f"({others} record(s) of other tenants not shown: this lists tenant {tenant}'s;"
            " set RUNFLEET_TENANT to see another's)"
        )


@dlq_group.command("show")
@click.argument("record_id", type=int)
@json_option
@command
async def dlq_show(record_id: int, as_json: bool) -> None:
    """Show one record, its decoded body where decodable, and its run's status.

    \b
    Example:
      runfleet dlq show 42
    """
    async with open_env(create_store=False) as env:
        detail = await ops.show_record(env, record_id)
        if await ops.record_owner(env, detail.record, env.tenant) != env.tenant:
            raise _not_this_tenants(record_id, env.tenant)
        view = detail_view(detail)
    if as_json:
        echo_json(view)
    else:
        for line in detail_lines(view):
            click.echo(line)


def replay_view(report: ReplayReport) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for outcome in report.outcomes:
        if outcome.run is not None:
            results.append(
                {
                    "id": outcome.record_id,
                    "run_id": outcome.run.run_id,
                    "attempt": outcome.run.attempt,
                    "replayed": True,
                }
            )
        else:
            assert outcome.error is not None
            error = outcome.error.to_dict()
            results.append({"id": outcome.record_id, "replayed": False, "error": error})
    out: dict[str, Any] = {"results": results}
    if report.not_attempted:
        out["not_attempted"] = list(report.not_attempted)
    return out


@dlq_group.command("replay")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "all_", is_flag=True, help="every record (with --reason, those only)")
@click.option("--reason", type=REASON, help="with --all: only records with this reason")
@json_option
@command
async def dlq_replay(ids: tuple[int, ...], all_: bool, reason: str | None, as_json: bool) -> None:
    """Replay records as fresh attempts of their runs.

    \b
    Example:
      runfleet dlq replay 42 43
      runfleet dlq replay --all --reason retries_exhausted
    """
    selected = _ids_or_all(ids, all_, {"--reason": reason})
    async with open_env(create_store=False) as env:
        if selected is None:  # --all: this tenant's records (another's would each be refused)
            every = await ops.select_records(env, None, reason=reason)
            mine = await ops.records_of(env, every, env.tenant, env.tenant)
            selected = tuple(r.id for r in mine)
        report = await ops.replay_records(env, selected, reason=reason)
    if as_json:
        echo_json(replay_view(report))
    else:
        for outcome in report.outcomes:
            if outcome.run is not None:
                run = outcome.run
                click.echo(f"replayed {outcome.record_id}: run {run.run_id} attempt {run.attempt}")
                continue
            assert outcome.error is not None
            line = f"{outcome.record_id}: [{outcome.error.code}] {outcome.error.message}"
            click.echo(f"{'failed ' if outcome.error is report.stopped_by else 'refused'}  {line}")
            if outcome.error.remedy:
                click.echo(f"  remedy: {outcome.error.remedy}")
        if report.not_attempted:
            click.echo(f"not attempted: {', '.join(map(str, report.not_attempted))}")
    if report.stopped_by is not None:
        raise SystemExit(EXIT_UNREACHABLE)
    if any(not outcome.replayed for outcome in report.outcomes):
        raise SystemExit(EXIT_REFUSED)


@dlq_group.command("purge")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "all_", is_flag=True, help="every record (narrowed by the filters)")
@click.option("--reason", type=REASON, help="with --all: only records with this reason")
@click.option(
    "--older-than", type=DURATION, help="with --all: only records older than this, e.g. 7d"
)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@json_option
@command
async def dlq_purge(
    ids: tuple[int, ...],
    all_: bool,
    reason: str | None,
    older_than: timedelta | None,
    yes: bool,
    as_json: bool,
) -> None:
    """Remove records for good (prints what it removed).

    \b
    Example:
      runfleet dlq purge 42
      runfleet dlq purge --all --reason malformed --older-than 7d --yes
    """
    selected = _ids_or_all(ids, all_, {"--reason": reason, "--older-than": older_than})
    age = older_than
    async with open_env(create_store=False) as env:
        found = await ops.select_records(env, selected, reason=reason, older_than=age)
        records = await ops.records_of(env, found, env.tenant, env.tenant)
        if selected is not None and len(records) != len(found):
            theirs = sorted({r.id for r in found} - {r.id for r in records})
            raise _not_this_tenants(theirs[0], env.tenant)
        if not records:
            echo_json({"removed": []}) if as_json else click.echo("nothing to purge")
            return
        if not yes:
            listing = ", ".join(str(r.id) for r in records[:20])
            more = f" and {len(records) - 20} more" if len(records) > 20 else ""
            confirm_or_refuse(
                f"purge {len(records)} record(s): {listing}{more}?", nothing_done="nothing purged"
            )
        removed = await ops.purge_records(env, [r.id for r in records])
    if as_json:
        echo_json({"removed": removed})
    else:
        for rid in removed:
            click.echo(f"removed {rid}")
