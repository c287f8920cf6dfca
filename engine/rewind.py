"""Rewind (SPEC §6.7): move a run's checkpoint *backwards* to node X, then park it
`paused_operator`; only an explicit resume continues it.

Dropped: X and every node forward-reachable from X that cannot reach X back. A node that can
reach X back is in a loop with X: it is kept, because the loop body re-reads it on the way round.
Budget accounting and loop counters stay (SPEC §13.7).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

from engine.loader import LoadedWorkflow, load_stored_workflow
from engine.refusals import RewindRefused, RunBusy, next_step
from engine.workflow import Workflow
from store import (
    CasConflict,
    Checkpoint,
    Eq,
    LeaseFree,
    RunDocument,
    RunStatus,
    RunStore,
    Update,
    lease_is_free,
    utcnow,
)

REWINDABLE = frozenset(
    {
        RunStatus.FAILED,
        RunStatus.FAILED_RESUMABLE,
        RunStatus.CANCELLED,
        RunStatus.PAUSED_OPERATOR,
        RunStatus.PAUSED_WAITING_HUMAN,
        RunStatus.QUEUED,
    }
)


def reachable(workflow: Workflow, start: str) -> set[str]:
    """Every node reachable from `start` by one or more edges."""
    return _closure(workflow.successors(start), workflow.successors)


def reaching(workflow: Workflow, target: str) -> set[str]:
    """Every node from which `target` is reachable by one or more edges."""
    return _closure(workflow.predecessors(target), workflow.predecessors)


def _closure(first: Iterable[str], step: Callable[[str], Iterable[str]]) -> set[str]:
    """Every node `step` leads to from `first`, walked once each (no recursion: a scale drill's
    1 500-node chain)."""
    seen: set[str] = set()
    stack = list(first)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def dropped_by_rewind(workflow: Workflow, node: str) -> set[str]:
    """`node` and what lies after it but cannot lead back to it: two walks, linear in the
    edges (a scale drill: one walk per node after it took 3 minutes on a 1 500-node chain,
    and froze the API serving the rewind)."""
    return {node} | (reachable(workflow, node) - reaching(workflow, node))


@dataclass(frozen=True, slots=True)
class RewindResult:
    run: RunDocument
    dropped: list[str]


async def rewind(
    store: RunStore,
    run_id: str,
    node: str,
    *,
    new_source: LoadedWorkflow | None = None,
    skew_s: float = 2.0,
) -> RewindResult:
    run = await store.get_run(run_id)
    if run.status not in REWINDABLE:
        raise RewindRefused(
            f"run {run_id} is {run.status}: it cannot be rewound", remedy=next_step(run.status)
        )
    now = utcnow()
    skew = timedelta(seconds=skew_s)
    if not lease_is_free(run, now, skew):
        raise RunBusy(run_id)
    if run.checkpoint is None:
        raise RewindRefused(
            f"run {run_id} has no checkpoint to rewind",
            remedy="it has completed no node, so there is nothing to move back;"
            " `runfleet status RUN` says what it waits for",
        )
    loaded = new_source or load_stored_workflow(run.workflow.source, f"run {run_id}")
    workflow = loaded.workflow
    if node not in workflow.nodes:
        raise RewindRefused(f"run {run_id}: no node {node!r} in the workflow")
    cp = run.checkpoint
    reached = set(cp.completed) | set(cp.outputs) | {cp.restart_node}
    if node not in reached:
        raise RewindRefused(f"run {run_id} never reached node {node!r}")
    dropped = sorted(n for n in dropped_by_rewind(workflow, node) if n in reached)
    new_cp = Checkpoint.model_validate(cp.model_dump())
    for n in dropped:
        new_cp.outputs.pop(n, None)
        new_cp.node_retries.pop(n, None)
    new_cp.completed = [n for n in new_cp.completed if n not in dropped]
    new_cp.restart_node = node
    new_cp.pending_interaction = None
    fields: dict[str, object] = {
        "status": RunStatus.PAUSED_OPERATOR,
        "checkpoint": new_cp.model_dump(),
        "failure_code": None,
        "error": None,
        "cause_code": None,
    }
    source_changed = new_source is not None and new_source.source_hash != run.workflow.source_hash
    if source_changed and new_source is not None:
        fields["workflow"] = {
            "name": workflow.name,
            "source": new_source.source,
            "source_hash": new_source.source_hash,
        }
    discarded = run.status is RunStatus.QUEUED
    result = await store.update_run(
        run_id,
        [Eq("version", run.version), Eq("status", run.status), LeaseFree(now, skew)],
        Update(set=fields, unset=["resume_spec"] if discarded else []),
    )
    if isinstance(result, CasConflict):
        current = result.current
        if current is not None and not lease_is_free(current, utcnow(), skew):
            raise RunBusy(run_id)
        raise RewindRefused(
            f"run {run_id} changed while rewinding",
            remedy="look at it (`runfleet status RUN`), then retry the rewind",
        )
    await store.retire_interactions(run_id)
    await store.append_event(
        run_id,
        "run_rewound",
        {
            "from_node": cp.restart_node,
            "to_node": node,
            "dropped_nodes": dropped,
            "source_changed": source_changed,
            "discarded_attempt": run.attempt if discarded else None,
        },
        attempt=result.attempt,
    )
    return RewindResult(result, dropped)
