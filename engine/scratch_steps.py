"""The execution's two scratch steps (SPEC §7.3-§7.5): the restore before the first node and the
bank at teardown. They live here, not in `execution.py`, so the walk stays readable; what they
do to the bank itself is `engine.scratch.ScratchBank`'s.

Who banks: an execution whose deployment is not host-backed (§7.2b), or whose workflow picks a
driver other than `local`, and only when its sandbox ran (an execution that never started one
left the scratch as the record describes it). Who restores: the same, when the record names a
bank the run has not forsaken (§7.5: an accepted loss neither restores nor refuses).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from engine.config import EngineSettings
from engine.events import EventLog
from engine.fencing import FencedWriter
from engine.outcome import CancelReason, Failed, Finished, Interrupted, Outcome
from engine.sandbox.errors import SandboxError
from engine.sandbox.protocols import Sandbox, SandboxCapabilities, SandboxDriver
from engine.scratch import ScratchBank, moved_past, remove_tree
from engine.workflow import Workflow
from store import BlobStore, Checkpoint, RunDocument, ScratchRecord, utcnow


class Execution(Protocol):
    """What the two steps read of `engine.execution.Execution` (which imports this module, so
    the arrow points one way)."""

    run_id: str
    token: str
    run_doc: RunDocument
    blobs: BlobStore | None
    checkpoint: Checkpoint
    driver: SandboxDriver
    events: EventLog
    host_backed: bool
    scratch_held: bool
    scratch_marked: bool
    settings: EngineSettings
    writer: FencedWriter

    @property
    def scratch(self) -> Path: ...

    @property
    def workflow(self) -> Workflow: ...

    @property
    def sandbox(self) -> Sandbox | None: ...

    async def ensure_sandbox(self) -> Sandbox: ...


__all__ = ["banks", "mark_unbanked", "restore_scratch", "teardown_scratch"]

log = logging.getLogger(__name__)


def banks(execution: Execution) -> bool:
    """This execution's scratch must be banked to follow the run (§7.2b)."""
    driver = execution.workflow.sandbox.driver
    return not execution.host_backed or driver not in (None, "local")


def _capabilities(execution: Execution) -> SandboxCapabilities:
    """The capabilities of the driver this workflow's sandbox runs on (the file wins, §6.1)."""
    pick = getattr(execution.driver, "driver", None)  # a DriverRouter: the workflow's driver
    driver = pick(execution.workflow.sandbox.driver) if callable(pick) else execution.driver
    caps: SandboxCapabilities = driver.capabilities
    return caps


def _bank(execution: Execution) -> ScratchBank:
    settings = execution.settings
    return ScratchBank(
        run_id=execution.run_id,
        token=execution.token,
        blobs=execution.blobs,
        writer=execution.writer,
        events=execution.events,
        cap_bytes=int(settings.scratch_cap),
        budget_s=settings.scratch_bank_budget.total_seconds(),
        host_scratch=execution.scratch,
        max_uncompressed_bytes=settings.scratch_uncompressed_bound,
    )


async def restore_scratch(execution: Execution) -> Failed | None:
    """Before the first node (§7.4): start the sandbox eagerly and restore the bank the record
    names; a `Failed` (not portable: held; restore failed: transient) when it cannot."""
    if not banks(execution):
        return None
    rec = execution.run_doc.scratch
    caps = _capabilities(execution)
    # An `unknown` record with a key (`mark_unbanked`) still names the bank the scratch was
    # restored from: no sandbox node finished since (else the resume was refused), so it holds.
    restorable = rec is not None and rec.state in ("banked", "unknown") and rec.key is not None
    if rec is None or not restorable or rec.forsaken:
        if caps.host_backed_scratch and execution.scratch.exists():
            # A fresh scratch: nothing of another execution's leaks in. The `exists()` is one
            # stat on the loop; the thread hop it spares was 5 % of a compute-only run's CPU
            # (issue 19, `py-spy --gil`), where there is almost never a directory to remove.
            await asyncio.to_thread(_fresh, execution)
        if rec is not None and rec.forsaken:
            cp = execution.run_doc.checkpoint or Checkpoint()
            await execution.events.emit(
                "sandbox_scratch_restored",
                restored=False,
                bytes=0,
                stale=rec.state == "banked" and moved_past(cp, rec),
                accepted=True,
                reason="the scratch loss was accepted (--accept-scratch-loss)",
            )
        return None
    try:
        sandbox = await execution.ensure_sandbox()
    except SandboxError as exc:
        execution.scratch_held = True
        return Failed(exc.failure_code or "SANDBOX_START_FAILED", f"restore: {exc}")
    cp = execution.run_doc.checkpoint or Checkpoint()
    failed = await _bank(execution).restore(
        sandbox, rec, host_dir=caps.host_backed_scratch, stale=moved_past(cp, rec)
    )
    if failed is not None:
        execution.scratch_held = True
    return failed


async def mark_unbanked(execution: Execution) -> None:
    """Before this execution's first tool node (the first thing that may write the scratch), on
    a deployment that banks (adr/0011, amendment): the record says the scratch is `unknown`
    from here on and names this lease token, keeping the bank (key, progress) it was restored
    from. Teardown replaces it with what it banks; a runner killed before its teardown leaves
    it, so a resume after one of this execution's sandbox nodes finished is refused
    `SCRATCH_NOT_PORTABLE` (§7.4, `moved_past`) instead of running on an empty or older
    scratch. A new record clears `forsaken` (§7.3)."""
    if execution.scratch_marked or not banks(execution) or execution.scratch_held:
        return
    execution.scratch_marked = True
    rec = execution.run_doc.scratch
    if rec is not None and rec.state == "unknown" and rec.lease_token == execution.token:
        return
    if rec is not None and rec.state == "unbankable" and not rec.forsaken:
        return  # already refuses every resume until the loss is accepted
    if rec is not None and not rec.forsaken and rec.state in ("banked", "empty", "unknown"):
        # the scratch is the one this record describes (restored, or empty since then)
        marker = rec.model_copy(update={"state": "unknown", "lease_token": execution.token})
    else:  # none yet, or forsaken: a fresh scratch, as of this checkpoint
        marker = ScratchRecord(state="unknown", progress=execution.checkpoint.progress)
        marker.lease_token = execution.token
    marker.at = utcnow()
    await execution.writer.write_record({"scratch": marker.model_dump()})
    execution.run_doc = execution.run_doc.model_copy(update={"scratch": marker})


def _fresh(execution: Execution) -> None:
    remove_tree(execution.scratch)


async def teardown_scratch(execution: Execution, outcome: Outcome | None) -> None:
    """§7.3 at teardown: a finished run drops its bank; a lost lease, a held bank or a sandbox
    that never ran banks nothing; otherwise the scratch is banked within the bank budget."""
    if execution.sandbox is None and not isinstance(outcome, Finished):
        # Nothing ran in a sandbox: the last bank still stands. Checked first, so a teardown
        # after an error under the held lease (a workflow that no longer loads) reads nothing.
        return
    if not banks(execution) or execution.writer.lost:
        return
    if isinstance(outcome, Interrupted) and outcome.reason is CancelReason.LEASE_LOST:
        return
    bank = _bank(execution)
    if isinstance(outcome, Finished):
        await bank.drop()
        return
    sandbox = execution.sandbox
    if execution.scratch_held or sandbox is None:
        return
    caps = _capabilities(execution)
    try:
        await asyncio.wait_for(
            bank.bank(
                sandbox,
                host_dir=caps.host_backed_scratch,
                process_isolated=caps.process_isolated,
                progress=execution.checkpoint.progress,
            ),
            execution.settings.scratch_bank_budget.total_seconds(),
        )
    except TimeoutError:
        log.error("run %s: the scratch bank passed its budget", execution.run_id)
