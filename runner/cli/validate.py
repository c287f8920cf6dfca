"""`runfleet validate FILE` (SPEC v2.2 §10): load and check a workflow with no fleet and no
store, and print what the loader understood — the nodes, the edges, the vars — so a person
writing a workflow sees the graph the engine will walk before anything runs.

The checks are the loader's own (the same ones `launch` and `run` apply, SPEC §6.1): a file that
loads here loads there. An invalid file exits 3 like every refusal, listing every problem with
its file, field and line, not only the first. A file that is not there is a bad argument, not a
bad workflow: a usage error (exit 2), as `run`, `launch` and every `--file` answer it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from engine.errors import WorkflowInvalid
from engine.loader import LoadedWorkflow, load_workflow_file
from engine.references import references
from engine.workflow import CallNode, ComputeNode, FailNode, HumanNode, Node, ToolNode, Workflow
from runner.cli.errors import EXIT_REFUSED
from runner.cli.runtime import command, json_option
from runner.cli.views import echo_json


@click.command("validate")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@command
async def validate_cmd(file: Path, as_json: bool) -> None:
    """Load and check a workflow file (no fleet, no store); print its nodes and edges.

    Exit 0 when the file loads, 3 when it does not (each problem names the file, the field and
    the line), 2 when there is no such file.

    Example: runfleet validate examples/approval.yaml
    """
    try:
        loaded = load_workflow_file(file)
    except WorkflowInvalid as exc:
        _refuse(exc, as_json=as_json)
    if as_json:
        echo_json(workflow_view(loaded))
    else:
        for line in describe(loaded):
            click.echo(line)


def _refuse(exc: WorkflowInvalid, *, as_json: bool) -> None:
    problems = [
        {"file": exc.file, "field": p.field, "line": p.line, "message": p.message}
        for p in exc.problems
    ]
    if as_json:
        echo_json({"valid": False, "error": {**exc.to_dict(), "problems": problems}})
    else:
        click.echo(f"error [{exc.code}]: {exc.file} does not load", err=True)
        for p in problems:
            where = f"{p['field']}: " if p["field"] else ""
            click.echo(f"  {p['file']}:{p['line']}: {where}{p['message']}", err=True)
        click.echo(f"  remedy: {exc.remedy}", err=True)
    sys.exit(EXIT_REFUSED)


def unreachable(workflow: Workflow) -> list[str]:
    """Nodes no path from `entry` reaches: loadable, but they can never run."""
    seen = {workflow.entry}
    todo = [workflow.entry]
    while todo:
        for nxt in workflow.successors(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return [n for n in workflow.nodes if n not in seen]


def warnings(workflow: Workflow) -> list[str]:
    """What loads but will not do what it looks like it does (found by a workflow walkthrough):
    a node nothing reaches; a resumable fail node without the one guard a resume re-judges
    (it ends the run `failed`, as docs/workflows.md says, and that is knowable now); a cycle
    no edge of which has a `loop` cap, with no iteration budget either, which only a person
    stops; an `outputs.X` (`outputs['X']`) where no node is X (`engine.references`)."""
    said = [
        f"node {nid!r} is not reachable from entry {workflow.entry!r}"
        for nid in unreachable(workflow)
    ]
    for nid, node in workflow.nodes.items():
        if isinstance(node, FailNode) and node.resumable:
            preds = workflow.predecessors(nid)
            if nid == workflow.entry:
                said.append(f"fail node {nid!r} is resumable but is the entry: the run ends failed")
            elif len(preds) != 1:
                said.append(
                    f"fail node {nid!r} is resumable but has {len(preds)} predecessors (a guard"
                    " needs exactly one): the run ends failed"
                )
    if workflow.budget.max_iterations is None:
        for cycle in _uncapped_cycles(workflow):
            said.append(
                f"nodes {', '.join(repr(n) for n in cycle)} form a cycle with no `loop` cap on"
                " any of its edges and no budget max_iterations: nothing stops it but a cancel"
            )
    for where, name in dict.fromkeys(references(workflow, "outputs")):
        if name not in workflow.nodes:
            said.append(
                f"{where} names outputs.{name}, but no node is called {name!r}: {_then(where)}"
            )
    for where, name in dict.fromkeys(references(workflow, "vars")):
        if name not in workflow.vars:
            declared = ", ".join(workflow.vars) or "none"
            said.append(
                f"{where} names vars.{name}, but the workflow declares no var {name!r}"
                f" (declared: {declared}): {_then(where)}"
            )
    return said


def _then(where: str) -> str:
    """What a reference to nothing does when it runs: a human or fail node's message keeps
    its stop and shows raw (a walkthrough: the warning said the pause would fail)."""
    if where.startswith("the message of"):
        return "the message shows raw, unrendered, when the node runs (its stop still happens)"
    return "it fails EXPRESSION_FAILED when it runs"


def _uncapped_cycles(workflow: Workflow) -> list[list[str]]:
    """The strongly connected groups of nodes (a self-edge included) none of whose internal
    edges has a `loop`, in file order. Tarjan's, without recursion (a scale drill: a chain of
    1 000 nodes was `internal` RecursionError), and one pass over the edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    group_of: dict[str, int] = {}
    groups: list[list[str]] = []
    for root in workflow.nodes:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(workflow.successors(root))))]
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(workflow.successors(nxt)))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    group_of[top] = len(groups)
                    group.append(top)
                    if top == node:
                        break
                groups.append(group)
    inside: set[int] = set()
    capped: set[int] = set()
    for edge in workflow.edges:
        g = group_of.get(edge.from_)
        if g is not None and g == group_of.get(edge.to):
            inside.add(g)
            if edge.loop:
                capped.add(g)
    order = {nid: i for i, nid in enumerate(workflow.nodes)}
    uncapped = [sorted(groups[g], key=order.__getitem__) for g in inside - capped]
    return sorted(uncapped, key=lambda group: order[group[0]])


def workflow_view(loaded: LoadedWorkflow) -> dict[str, Any]:
    wf = loaded.workflow
    return {
        "valid": True,
        "file": loaded.filename,
        "name": wf.name,
        "description": wf.description,
        "source_hash": loaded.source_hash,
        "entry": wf.entry,
        "vars": {name: spec.model_dump() for name, spec in wf.vars.items()},
        "budget": wf.budget.model_dump(exclude_none=True),
        "sandbox": wf.sandbox.model_dump(),
        "nodes": [{"id": nid, **node.model_dump()} for nid, node in wf.nodes.items()],
        "edges": [e.model_dump(by_alias=True, exclude_none=True) for e in wf.edges],
        "unreachable": unreachable(wf),
        "warnings": warnings(wf),
    }


def describe(loaded: LoadedWorkflow) -> list[str]:
    wf = loaded.workflow
    lines = [
        f"workflow  {wf.name}  ({loaded.filename}, sha256 {loaded.source_hash[:12]})",
        f"entry     {wf.entry}",
    ]
    for name, spec in wf.vars.items():
        default = "" if spec.default is None else f" = {spec.default!r}"
        lines.append(f"var       {name}: {spec.type}{default}")
    budget = wf.budget.model_dump(exclude_none=True)
    if budget:
        lines.append("budget    " + ", ".join(f"{k}={v}" for k, v in budget.items()))
    lines.append(f"sandbox   {wf.sandbox.driver or 'RUNFLEET_SANDBOX (default local)'}")
    width = max(len(n) for n in wf.nodes)
    lines.append(f"nodes ({len(wf.nodes)}):")
    for nid, node in wf.nodes.items():
        lines.append(f"  {nid:<{width}}  {node.kind:<8} {_summary(node)}".rstrip())
    lines.append(f"edges ({len(wf.edges)}):")
    for e in wf.edges:
        extra = f"  when {e.when}" if e.when else ""
        if e.loop:
            extra += f"  loop {e.loop.name} max {e.loop.max}"
        lines.append(f"  {e.from_} -> {e.to}{extra}")
    lines += [f"warning: {said}" for said in warnings(wf)]
    lines.append(f"ok: {loaded.filename} loads ({len(wf.nodes)} nodes, {len(wf.edges)} edges)")
    return lines


def _summary(node: Node) -> str:
    if isinstance(node, ToolNode):
        retry = f", retry {node.retry.max}" if node.retry else ""
        return f"run {_short(node.run)} (output {node.output}, timeout {node.timeout:g}s{retry})"
    if isinstance(node, ComputeNode):
        return "set " + ", ".join(node.set)
    if isinstance(node, HumanNode):
        asks = f"asks {_short(node.message)}; " if node.message else ""
        qs = ", ".join(
            f"{q.name} ({q.type}{'' if q.required else ', optional'})" for q in node.questions
        )
        return f"{asks}questions {qs}"
    if isinstance(node, CallNode):
        return f"call {node.function} (timeout {node.timeout:g}s)"
    assert isinstance(node, FailNode)
    resumable = " (resumable)" if node.resumable else ""
    return f"fail {node.code}{resumable}"


def _short(text: str, limit: int = 60) -> str:
    one = " ".join(text.split())
    return repr(one if len(one) <= limit else one[: limit - 3] + "...")
