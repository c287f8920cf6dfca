"""Running one node (SPEC §6.1, §6.6): its in-process retries, the race against the cancel
signal, the node kinds, and where an oversized output goes. A mixin of `Execution`, kept apart
so the walk in `execution.py` reads in one screen; it reads only what the attributes and stubs
at the top of `NodeRuns` name, which `Execution` provides (the stubs are never called).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from engine.attachments import RunAttachments
from engine.budget import exceeded
from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.events import EventLog
from engine.failures import FailureCode, node_retries_for, node_retry_backoff
from engine.fencing import FencedWriter
from engine.nodes import (
    CallContext,
    NodeFailed,
    NodeOk,
    NodeResult,
    run_call,
    run_compute,
    run_tool,
)
from engine.outcome import Failed
from engine.sandbox.errors import SandboxError, SandboxLost
from engine.sandbox.protocols import Sandbox
from engine.workflow import CallNode, ComputeNode, ToolNode, Workflow
from store import BlobStore, Checkpoint, RunDocument, StoreError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetSpent:
    """A node's in-process retry was due, but the attempts so far spent the run's budget
    (`why` says which cap): the walk pauses for the budget at the node instead of retrying."""

    failed: NodeFailed
    why: str


class NodeRuns:
    """What `Execution` gives this mixin, then running one node. The `NotImplementedError`
    stubs are the host's members, declared for the type checker: `Execution` defines each."""

    run_id: str
    run_doc: RunDocument
    checkpoint: Checkpoint
    writer: FencedWriter
    events: EventLog
    cancel: CancelSignal
    settings: EngineSettings
    blobs: BlobStore | None

    @property
    def attached(self) -> RunAttachments:
        raise NotImplementedError

    @property
    def workspace(self) -> Path:
        raise NotImplementedError

    @property
    def workflow(self) -> Workflow:
        raise NotImplementedError

    def scope(self, *, in_sandbox: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    async def _ensure_sandbox(self) -> Sandbox:
        raise NotImplementedError

    async def _execute_with_retries(self, node_id: str) -> NodeResult | BudgetSpent | None:
        node = self.workflow.nodes[node_id]
        cp = self.checkpoint
        declared = getattr(getattr(node, "retry", None), "max", None)
        backoff = getattr(getattr(node, "retry", None), "backoff", None) or 1.0
        while True:
            if isinstance(node, ComputeNode):  # no side effect: it rides with the boundary
                self.events.defer("node_started", node=node_id)
            else:
                await self.events.emit("node_started", node=node_id)
            if self.cancel.lease_spent():
                # Past the lease's loss margin an adopter may hold the run: the node does not
                # start (SPEC §13.1), and the execution ends as one that lost its lease.
                log.warning(
                    "run %s: lease past its loss margin; %s not started", self.run_id, node_id
                )
                return None
            started = time.monotonic()
            if isinstance(node, ComputeNode):
                # Never suspends (expressions over the checkpoint), so there is nothing to race:
                # a cancel is seen at the next boundary. Two tasks per node saved (issue 19).
                result = None if self.cancel.is_set else await self._execute(node_id)
            else:
                result = await self._race(self._execute(node_id))
            cp.usage.elapsed += time.monotonic() - started
            cp.usage.iterations += 1
            if result is None:
                return None
            cp.usage.cost_usd += result.cost_usd
            if isinstance(result, NodeOk):
                return result
            used = cp.node_retries.get(node_id, 0)
            if used >= node_retries_for(result.code, declared):
                return result  # the caller anchors the checkpoint, then says node_failed
            why = exceeded(self.run_doc.budget, cp.usage)
            if why is not None:  # retries cost like any attempt (found by review)
                return BudgetSpent(result, why)
            cp.node_retries[node_id] = used + 1
            failed = self.events.draft(
                "node_failed", node=node_id, code=result.code, error=result.error, retry=True
            )
            await self.writer.write_checkpoint(cp, events=[failed])
            pause = node_retry_backoff(used + 1, base_s=float(backoff))
            if await self._race(asyncio.sleep(pause, result)) is None:
                return None

    async def _execute(self, node_id: str) -> NodeResult:
        node = self.workflow.nodes[node_id]
        scope = self.scope(in_sandbox=isinstance(node, ToolNode))
        if isinstance(node, ComputeNode):
            return await run_compute(node, scope)
        if isinstance(node, ToolNode):
            try:
                if self.run_doc.attachments:  # delivered, or refused, before the node renders
                    await self._ensure_sandbox()
                # With a blob store an output over the cap spills (SPEC §2), so stdout is
                # captured up to the spill bound; without one, up to the cap itself.
                spills = self.blobs is not None
                return await run_tool(
                    node_id,
                    node,
                    scope,
                    self._ensure_sandbox,
                    self.events,
                    self.settings.output_spill_max if spills else self.settings.output_cap,
                    limit_name="RUNFLEET_OUTPUT_SPILL_MAX" if spills else "RUNFLEET_OUTPUT_CAP",
                    events_max=self.settings.output_events_max,
                )
            except SandboxError as exc:
                if isinstance(exc, SandboxLost):  # SPEC §7.2: said, then the node fails at once
                    await self.events.emit("sandbox_lost", reason=exc.reason, message=str(exc))
                code = exc.failure_code or FailureCode.INTERNAL_ERROR
                return NodeFailed(code, f"{node_id}: {exc}")
        if isinstance(node, CallNode):
            ctx = CallContext(
                run_id=self.run_id,
                node=node_id,
                attempt=self.run_doc.attempt,
                # Copies: "read-only" in the docs, and a callable that wrote into them changed
                # the checkpoint, vars included (a walkthrough).
                vars=copy.deepcopy(self.checkpoint.vars),
                outputs=copy.deepcopy(self.checkpoint.outputs),
            )
            call = asyncio.ensure_future(run_call(node_id, node, scope, ctx))
            try:
                if await _within(call, node.timeout):
                    return call.result()
            except asyncio.CancelledError:  # a cancel or a drain: it reaches the call too
                call.cancel()
                raise
            await self._stop(call, what=f"{node_id}'s call after its timeout")
            return NodeFailed(
                FailureCode.TIMEOUT, f"{node_id}: timed out after {node.timeout:g}s", ctx.cost_usd
            )
        raise AssertionError(f"node kind {type(node).__name__} is not executable")

    async def _race(self, work: Coroutine[Any, Any, T]) -> T | None:
        """Run `work` unless the cancel signal fires first; then cancel it within the
        node-cancellation budget and return None."""
        task: asyncio.Task[T] = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.cancel.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        await self._stop(task, what="the node's work after a cancel")
        return None

    async def _stop(self, task: asyncio.Future[Any], *, what: str) -> None:
        """Cancel `task` and give it the node-cancellation budget to end. A task that swallows
        its cancellation is left behind, not waited for (`asyncio.wait_for` would wait for it
        past any bound: a walkthrough's call that caught `CancelledError` "finished" long after
        its timeout)."""
        task.cancel()
        if not await _within(task, self.settings.node_cancel_budget.total_seconds()):
            log.warning("run %s: %s ignored its cancellation; left running", self.run_id, what)
            task.add_done_callback(_quietly)

    async def _store_output(self, node_id: str, output: Any) -> Any:
        """Outputs over the cap spill to the blob store (SPEC §2); without one they fail."""
        encoded = json.dumps(output, default=str).encode()
        if len(encoded) <= self.settings.output_cap:
            return output
        if self.blobs is None:
            return Failed(
                FailureCode.OUTPUT_TOO_LARGE,
                f"{node_id}: output of {len(encoded)} bytes exceeds {self.settings.output_cap}",
                node=node_id,
            )
        key = f"runs/{self.run_id}/outputs/{node_id}/{self.checkpoint.progress}"
        return {"$blob": await self._spill(self.blobs, key, encoded), "bytes": len(encoded)}

    async def _spill(self, blobs: BlobStore, key: str, data: bytes) -> str:
        """Write once, never over a blob a checkpoint may name. A fenced execution of the same
        node at the same progress writes SPEC §2's key too, before or after its adopter: the
        second writer, unless it holds the same bytes (this execution's own create whose reply
        was lost), goes beside it under its lease token, which no other execution holds."""
        for candidate in (key, f"{key}.{self.writer.token}"):
            if await blobs.create_bytes(candidate, data) is not None:
                return candidate
            there = await blobs.stat(candidate)  # the size first: most often it differs
            if (
                there is not None
                and there.size == len(data)
                and await blobs.get_bytes(candidate) == data
            ):
                return candidate
        raise StoreError(
            f"run {self.run_id}: cannot spill an output: {key} and its token's key hold other "
            "bytes, and a spilled output is written once"
        )


async def _within(task: asyncio.Future[Any], seconds: float) -> bool:
    """Whether `task` is done within `seconds`; never cancels it, never waits longer."""
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return task in done


def _quietly(task: asyncio.Future[Any]) -> None:
    """A task left behind: its outcome is read so that asyncio does not report it."""
    if not task.cancelled():
        task.exception()
