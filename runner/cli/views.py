"""How runs and events look to people (tables, lines) and to programs (`--json`)."""

from __future__ import annotations

import json
from typing import Any

import click

from store import Event, RunDocument


def run_view(doc: RunDocument) -> dict[str, Any]:
    """The `--json` shape of a run (SPEC §10 fields first, then what an operator needs)."""
    cp = doc.checkpoint
    pending = cp.pending_interaction if cp else None
    return {
        "run_id": doc.run_id,
        "status": str(doc.status),
        "failure_code": doc.failure_code,
        "error": doc.error,
        "attempt": doc.attempt,
        "workflow": {"name": doc.workflow.name, "source_hash": doc.workflow.source_hash},
        "created_at": doc.created_at.isoformat(),
        "updated_at": doc.updated_at.isoformat(),
        "tenant": doc.tenant,
        "origin": str(doc.origin),
        "cause_code": doc.cause_code,
        "restart_node": cp.restart_node if cp else None,
        "outputs": cp.outputs if cp else {},
        "pending_questions": pending.get("questions") if pending else None,
        "budget": doc.budget.model_dump(),
        "usage": cp.usage.model_dump() if cp else None,
        "lease": None
        if doc.lease is None
        else {"owner": doc.lease.owner, "expires_at": doc.lease.expires_at.isoformat()},
        "cancel_requested": doc.cancel_requested,
    }


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def echo_run(doc: RunDocument) -> None:
    v = run_view(doc)
    click.echo(f"run       {v['run_id']}")
    click.echo(f"workflow  {v['workflow']['name']}  (attempt {v['attempt']}, {v['origin']})")
    click.echo(f"status    {v['status']}")
    if v["failure_code"]:
        click.echo(f"failure   {v['failure_code']}: {v['error']}")
    if v["restart_node"]:
        click.echo(f"at node   {v['restart_node']}")
    if v["pending_questions"]:
        click.echo("waiting for answers:")
        for q in v["pending_questions"]:
            req = "" if q.get("required", True) else " (optional)"
            click.echo(f"  {q['name']}: {q['type']}{req}  {q.get('description', '')}")
    if v["usage"]:
        u = v["usage"]
        click.echo(
            f"usage     {u['iterations']} node runs, {u['elapsed']:.1f}s, ${u['cost_usd']:.4f}"
        )
    for node, out in v["outputs"].items():
        text = json.dumps(out, default=str)
        click.echo(f"  {node} = {text if len(text) <= 200 else text[:197] + '...'}")


def event_line(event: Event) -> str:
    data = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in event.data.items())
    if event.type == "node_output":
        return f"  {event.data.get('node')}| {str(event.data.get('text', '')).rstrip()}"
    return f"{event.at.strftime('%H:%M:%S')} #{event.seq:<4} {event.type:<24} {data}"
