"""One execution of a claimed run: `run()` walks the graph from the checkpoint and returns an
`Outcome` with the sandbox still up; `teardown()` stops the sandbox (SPEC §5.4, §6).

The checkpoint is written (fenced) at every node boundary, so the next execution of the run
starts at `restart_node` and never re-executes a completed node (SPEC §13.6). A failure anchors
at the failing node; a cancel or pause anchors at the node about to run; a resumable `fail`
anchors at its guard (SPEC §6.5). Status writes are the caller's (see `settle.py`): the runner
must put a DLQ record before the status on a last delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from engine import attachments
from engine.budget import exceeded
from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.errors import ExpressionError
from engine.events import EventLog
from engine.expressions import evaluate
from engine.failures import (
    FailureCode,
)
from engine.fencing import FencedWriter, LeaseLost
from engine.loader import stored_workflow
from engine.node_runs import BudgetSpent, NodeRuns
from engine.nodes import (
    NodeFailed,
)
from engine.outcome import (
    CancelReason,
    Failed,
    Finished,
    Interrupted,
    Outcome,
    Paused,
)
from engine.sandbox.protocols import Sandbox, SandboxDriver, SandboxSpec
from engine.scratch import counts_for_bank, host_backed_of, remove_tree
from engine.scratch_steps import mark_unbanked, restore_scratch, teardown_scratch
from engine.stops import RunStops
from engine.vars import resolve_vars
from engine.workflow import FailNode, HumanNode, ToolNode, Workflow
from store import BlobStore, Checkpoint, RunDocument, RunStore


@dataclass(frozen=True, slots=True)
class EngineEnv:
    """What an execution needs from its host, the runner's or `runfleet run`'s alike."""

    store: RunStore
    driver: SandboxDriver
    settings: EngineSettings
    data_dir: Path
    blobs: BlobStore | None = None
    host_backed: bool | None = None
    """The deployment's scratch is host-backed (SPEC v2.2 §7.2b), decided once at start;
    None = read from the store and blob objects (`engine.scratch.host_backed_of`)."""


log = logging.getLogger(__name__)


class Execution(RunStops, NodeRuns):
    def __init__(
        self,
        *,
        store: RunStore,
        run: RunDocument,
        token: str,
        driver: SandboxDriver,
        settings: EngineSettings,
        cancel: CancelSignal,
        data_dir: Path,
        blobs: BlobStore | None = None,
        events: EventLog | None = None,
        host_backed: bool | None = None,
    ) -> None:
        self.store = store
        self.run_doc = run
        self.run_id = run.run_id
        self.token = token
        self.driver = driver
        self.settings = settings
        self.cancel = cancel
        self.blobs = blobs
        self.writer = FencedWriter(store, run.run_id, token, run.attempt, cancel)
        self.events = events or EventLog(store, run.run_id, run.attempt, token, cancel)
        self.writer.events = self.events
        self.checkpoint = (
            run.checkpoint.model_copy(deep=True) if run.checkpoint is not None else Checkpoint()
        )
        self.data_dir = data_dir
        self._workspace_made = False
        self._sandbox: Sandbox | None = None
        self._workflow: Workflow | None = None
        self.host_backed = (
            host_backed_of(settings.sandbox, store, blobs) if host_backed is None else host_backed
        )
        self.outcome: Outcome | None = None
        self.scratch_held = False
        """A restore failed: the bank is held, this execution must not bank over it (§7.4)."""
        self.scratch_marked = False
        """The record already says this execution may change the scratch (`mark_unbanked`)."""

    # The execution's directories are built when first used: a compute-only run uses none,
    # and building three `Path`s per claim was ≈ 2 % of a delivery (issue 19's profile).

    @cached_property
    def workspace(self) -> Path:
        return self.data_dir.joinpath("work", self.run_id, self.token)

    @cached_property
    def scratch(self) -> Path:
        return self.data_dir.joinpath("scratch", self.run_id)

    @cached_property
    def attached(self) -> attachments.RunAttachments:
        return attachments.RunAttachments(
            self.run_doc,
            self.driver,
            self.blobs,
            self.data_dir.joinpath("attachments", self.run_id, self.token),
        )

    @classmethod
    def claimed(
        cls, env: EngineEnv, run: RunDocument, cancel: CancelSignal, events: EventLog
    ) -> Execution:
        """The execution of a claim just won (fleet or local): the lease's token names it."""
        assert run.lease is not None
        return cls(
            store=env.store,
            run=run,
            token=run.lease.token,
            driver=env.driver,
            settings=env.settings,
            cancel=cancel,
            data_dir=env.data_dir,
            blobs=env.blobs,
            events=events,
            host_backed=env.host_backed,
        )

    @property
    def workflow(self) -> Workflow:
        """The run's stored source, parsed when first needed — inside `begin()`/`run()`, never
        in the constructor: a source that no longer loads is an error raised under the held
        lease, which the runner turns into one `INTERNAL_ERROR` park (SPEC v2.2 §5.1)."""
        if self._workflow is None:
            self._workflow = stored_workflow(self.run_doc.workflow.source, f"run {self.run_id}")
            if not self.checkpoint.vars:
                self.checkpoint.vars = resolve_vars(
                    self._workflow, self.run_doc.inputs, at_launch=False
                )
        return self._workflow

    # -- the public steps ----------------------------------------------------------------------

    async def begin(self, path: str, runner: str) -> None:
        """What every claim does after its CAS won and before its first node (SPEC §5.3), in
        that order: stop the run's sandboxes that carry another execution's token, then say
        `run_claimed` (and `run_workspace_reset` when a checkpoint exists)."""
        stopped = await self.driver.stop_others(self.run_id, keep_token=self.token)
        if stopped:
            log.info("run %s: stopped sandboxes of earlier executions: %s", self.run_id, stopped)
        # Narration with nothing of its own to show: it rides with the first write (the node
        # boundary, or the outcome's status), which lands before anything else is said.
        self.events.defer("run_claimed", path=path, runner=runner)
        if self.run_doc.checkpoint is not None:
            self.events.defer("run_workspace_reset")

    async def run(self) -> Outcome:
        try:
            self.outcome = await self._run()
        except LeaseLost:
            self.outcome = Interrupted(CancelReason.LEASE_LOST)
        return self.outcome

    async def teardown(self, outcome: Outcome | None = None) -> None:
        """Bank the scratch as the outcome says (SPEC §7.3: a finished run drops its bank, a
        lost lease banks nothing; `engine.scratch`), then stop the sandbox and drop the
        per-execution workspace. `outcome` defaults to what `run()` returned."""
        try:
            await teardown_scratch(self, outcome or self.outcome)
        finally:
            await self._stop_sandbox()

    def teardown_is_empty(self) -> bool:
        """No sandbox was started, the run has no scratch record to bank or drop, and no
        workspace was made: `teardown()` would do nothing, so the release may ride with the
        outcome's status write and keep SPEC §5.4's order (ADR-0014)."""
        return (
            self._sandbox is None
            and self.run_doc.scratch is None
            and not self.scratch_marked
            and not self._workspace_made
        )

    async def _stop_sandbox(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.stop()
            self._sandbox = None
        if self.workspace.exists():  # a compute-only run never made one: no thread hop
            with contextlib.suppress(OSError):  # what is left, gc takes
                await asyncio.to_thread(remove_tree, self.workspace)
        await self.attached.remove()

    # -- the walk ------------------------------------------------------------------------------

    async def _run(self) -> Outcome:
        workflow = self.workflow
        await self.attached.sign()
        cp = self.checkpoint
        if self.run_doc.checkpoint is not None and cp.restart_node is None and cp.progress > 0:
            # The last boundary was written and nothing is left to run: an adoption after the
            # final checkpoint (the status write was lost) must not start again at `entry`.
            return Finished()
        node_id = cp.restart_node or workflow.entry
        kinds = (n.kind for n in workflow.nodes.values())
        why = await self.attached.refuse_undeliverable(workflow.sandbox.driver, kinds, self.events)
        if why is not None:  # SPEC §8, §13.11: refused before the first node, naming them
            return Failed(FailureCode.ATTACHMENTS_UNDELIVERABLE, why, node=node_id)
        held = await restore_scratch(self)  # before the first node (SPEC §7.4)
        if held is not None:
            return Failed(held.code, held.error, node=node_id)
        node = workflow.nodes[node_id]
        if isinstance(node, HumanNode) and node_id in cp.outputs and cp.pending_interaction is None:
            # The fresh claim wrote the answers as this node's output (SPEC §5.3): they select
            # the outgoing edge; the node itself is not asked again.
            # Events are projections of what the checkpoint holds: they ride with it, so an
            # execution that lost its lease (the write was refused) appends nothing.
            self.events.defer("human_answers_recorded", node=node_id)
            self.events.defer("node_finished", node=node_id, in_sandbox=False, answered=True)
            nxt = await self._advance(node_id)
            if not isinstance(nxt, str):
                return nxt
            node_id = nxt

        while True:
            if self.cancel.is_set:
                return await self._stop_for_cancel(node_id)
            why = exceeded(self.run_doc.budget, cp.usage)
            if why is not None:
                cp.restart_node = node_id
                await self.writer.write_checkpoint(cp)
                return Paused("budget", node_id, detail=why)
            node = self.workflow.nodes[node_id]
            if isinstance(node, HumanNode):
                return await self._pause_for_human(node_id, node)
            if isinstance(node, FailNode):
                return await self._deliberate_failure(node_id, node)
            if isinstance(node, ToolNode):  # the nodes that run in the sandbox itself
                await mark_unbanked(self)  # before the first one (adr/0011, amendment)
            result = await self._execute_with_retries(node_id)
            if result is None:
                return await self._stop_for_cancel(node_id)
            if isinstance(result, BudgetSpent):
                cp.restart_node = node_id
                cp.node_retries.pop(node_id, None)
                failed = self.events.draft(
                    "node_failed",
                    node=node_id,
                    code=result.failed.code,
                    error=result.failed.error,
                    retry=False,
                )
                await self.writer.write_checkpoint(cp, events=[failed])
                return Paused("budget", node_id, detail=result.why)
            if isinstance(result, NodeFailed):
                cp.restart_node = node_id
                cp.node_retries.pop(node_id, None)
                failed = self.events.draft(
                    "node_failed", node=node_id, code=result.code, error=result.error, retry=False
                )
                await self.writer.write_checkpoint(cp, events=[failed])
                return Failed(result.code, result.error, node=node_id)
            stored = await self._store_output(node_id, result.output)
            if isinstance(stored, Failed):
                cp.restart_node = node_id
                await self.writer.write_checkpoint(cp)
                return stored
            cp.outputs[node_id] = stored
            cp.node_retries.pop(node_id, None)
            if node_id not in cp.completed:
                cp.completed.append(node_id)
            in_sandbox = counts_for_bank(node.kind)  # SANDBOX_KINDS (§7.4)
            if in_sandbox:
                cp.sandbox_progress = cp.sandbox_done[node_id] = cp.progress + 1
            self.events.defer("node_finished", node=node_id, in_sandbox=in_sandbox, answered=False)
            nxt = await self._advance(node_id)
            if not isinstance(nxt, str):
                return nxt
            node_id = nxt

    async def _advance(self, node_id: str) -> str | Outcome:
        """Select the edge out of a completed node and write the boundary checkpoint."""
        cp = self.checkpoint
        cp.progress += 1
        try:
            nxt = self._select_edge(node_id)
        except ExpressionError as exc:
            cp.restart_node = node_id
            await self.writer.write_checkpoint(cp)
            return Failed(FailureCode.EXPRESSION_FAILED, str(exc), node=node_id)
        if isinstance(nxt, Failed):
            cp.restart_node = node_id
            await self.writer.write_checkpoint(cp)
            return nxt
        cp.restart_node = nxt
        if nxt is not None and isinstance(self.workflow.nodes.get(nxt), HumanNode):
            # Arriving at a question (a loop's next round): the answers an earlier round left
            # as its output do not answer this one. Were they kept, a stop before it is asked
            # (budget, cancel, drain, crash) would resume into "answered" and pass the gate
            # with no person involved (found by review).
            cp.outputs.pop(nxt, None)
        if nxt is None and self.events.rides and self.teardown_is_empty():
            # The last boundary of a fleet run with nothing to tear down: the outcome's status
            # write follows at once and carries this checkpoint (`FencedWriter.defer_checkpoint`).
            self.writer.defer_checkpoint(cp)
            return Finished()
        await self.writer.write_checkpoint(cp)
        return Finished() if nxt is None else nxt

    def _select_edge(self, node_id: str) -> str | Failed | None:
        edges = self.workflow.outgoing(node_id)
        if not edges:
            return None
        scope = self.scope()
        skipped_loop = False
        for edge in edges:
            if edge.when is not None and not evaluate(edge.when, scope):
                continue
            if edge.loop is not None:
                count = self.checkpoint.loop_counters.get(edge.loop.name, 0)
                if count >= edge.loop.max:
                    skipped_loop = True
                    continue
                self.checkpoint.loop_counters[edge.loop.name] = count + 1
            return edge.to
        if skipped_loop:
            return Failed(FailureCode.LOOP_EXHAUSTED, f"{node_id}: loop exhausted", node=node_id)
        return Failed(
            FailureCode.NO_OUTGOING_EDGE, f"{node_id}: no outgoing edge matched", node=node_id
        )

    def scope(self, *, in_sandbox: bool = False) -> dict[str, Any]:
        """What expressions and templates see (SPEC §6.1), plus the caps and the accounting
        so a guard can compare progress with a budget a resume may raise."""
        cp = self.checkpoint
        answers: dict[str, Any] = {}
        for nid, node in self.workflow.nodes.items():
            if isinstance(node, HumanNode) and isinstance(cp.outputs.get(nid), dict):
                answers.update(cp.outputs[nid])
        return {
            "vars": cp.vars,
            "outputs": cp.outputs,
            "answers": answers,
            "loop": cp.loop_counters,
            "budget": self.run_doc.budget.model_dump(),
            "usage": cp.usage.model_dump(),
            "attachments": self.attached.scope(self.workflow.sandbox.driver, in_sandbox=in_sandbox),
        }

    @property
    def sandbox(self) -> Sandbox | None:
        return self._sandbox

    async def ensure_sandbox(self) -> Sandbox:
        return await self._ensure_sandbox()

    async def _ensure_sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._workspace_made = True
            self.workspace.mkdir(parents=True, exist_ok=True)
            self.scratch.mkdir(parents=True, exist_ok=True)
            seeded = await self.attached.prepare(self.workflow.sandbox.driver, self.events)
            self._sandbox = await self.driver.start(
                SandboxSpec(
                    run_id=self.run_id,
                    lease_token=self.token,
                    workspace_dir=self.workspace,
                    scratch_dir=self.scratch,
                    driver=self.workflow.sandbox.driver,  # the file wins (SPEC §6.1)
                    image=self.workflow.sandbox.options.get("image"),
                    resources=self.workflow.sandbox.options.get("resources") or {},
                    attachments_dir=seeded.host_dir,
                    seed_dirs=seeded.seed_dirs,
                )
            )
            await self.events.emit("sandbox_started", name=self._sandbox.name)
            if seeded.names:
                await self.events.emit("attachments_seeded", names=seeded.names, bytes=seeded.bytes)
        return self._sandbox
