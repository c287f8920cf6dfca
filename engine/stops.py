"""Where a walk stops short of its end (SPEC §6.2, §6.4, §6.5): a human pause, a deliberate
`fail` node, a cancel. Each writes the checkpoint anchored where the next execution must start —
a pause and a cancel at the node about to run, a resumable `fail` at its guard — and returns the
outcome; the status is the caller's to write (`settle.py`, the runner's disposition).

A mixin of `Execution` (kept apart so the walk itself reads in one screen).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.cancel import CancelSignal
from engine.errors import TemplateError
from engine.events import EventLog
from engine.fencing import FencedWriter
from engine.outcome import Cancelled, CancelReason, Failed, Interrupted, Outcome, Paused
from engine.templates import render
from engine.workflow import FailNode, HumanNode, Workflow
from store import Checkpoint, Interaction, RunDocument, RunStore, utcnow

log = logging.getLogger(__name__)


class RunStops:
    """A mixin of `Execution`: where a run stops short of its end. The `NotImplementedError`
    stubs are the host's members, declared for the type checker: `Execution` defines each."""

    store: RunStore
    run_doc: RunDocument
    run_id: str
    checkpoint: Checkpoint
    writer: FencedWriter
    events: EventLog
    cancel: CancelSignal

    @property
    def workflow(self) -> Workflow:
        raise NotImplementedError

    def scope(self) -> dict[str, Any]:
        raise NotImplementedError

    async def _pause_for_human(self, node_id: str, node: HumanNode) -> Outcome:
        cp = self.checkpoint
        questions = [q.model_dump() for q in node.questions]
        message, message_error = self._render_message(node.message)
        interaction_id = f"{self.run_id}:{node_id}:{cp.progress}"
        cp.restart_node = node_id
        cp.outputs.pop(node_id, None)
        cp.pending_interaction = {
            "id": interaction_id,
            "node": node_id,
            "message": message,
            "questions": questions,
        }
        await self.writer.write_checkpoint(cp)
        await self.store.put_interaction(
            Interaction(
                id=interaction_id,
                run_id=self.run_id,
                tenant=self.run_doc.tenant,
                node=node_id,
                attempt=self.run_doc.attempt,
                questions=questions,
                created_at=utcnow(),
            )
        )
        said: dict[str, Any] = {"message_error": message_error} if message_error else {}
        await self.events.emit(
            "human_input_requested", node=node_id, message=message, questions=questions, **said
        )
        return Paused("human", node_id)

    def _render_message(self, template: str) -> tuple[str, str | None]:
        """A human or fail node's `message` as it will be read, and why it did not render.

        It is the one template that never fails its node: the stop the node asks for (a pause
        for a person, the workflow's own failure) is what matters, and losing it to a typo in
        its wording would be worse. So a message that cannot render is kept raw, and the error
        is said beside it (the event's `message_error`, the failure's error), never dropped:
        a walkthrough found the raw `{{ outputs.a.missing }}` shown with no word of why."""
        if not template:
            return "", None
        try:
            return render(template, self.scope(), shell=False), None
        except TemplateError as exc:
            log.warning("run %s: a node's message did not render: %s", self.run_id, exc)
            return template, exc.message

    async def _deliberate_failure(self, node_id: str, node: FailNode) -> Outcome:
        cp = self.checkpoint
        preds = sorted(set(self.workflow.predecessors(node_id)))
        message, message_error = self._render_message(node.message)
        if not node.message:
            message = node.code
        elif message_error:
            message = f"{message} (the message did not render: {message_error})"
        # The entry has no guard however many edges lead back into it: the run never passed
        # one to get there (`Workflow.guard_of`; found by review).
        guarded = len(preds) == 1 and node_id != self.workflow.entry
        if node.resumable and guarded:
            # Anchor on the guard so a resume re-evaluates it (SPEC §6.5).
            cp.restart_node = preds[0]
            await self.writer.write_checkpoint(cp)
            return Failed(node.code, message, node=node_id, deliberate=True, resumable=True)
        warning = None
        if node.resumable:
            warning = (
                f"fail node {node_id!r} is resumable but is the entry (no guard leads to it):"
                " the run ends failed"
                if node_id == self.workflow.entry
                else f"fail node {node_id!r} is resumable but has {len(preds)} predecessors"
                " (a guard needs exactly one): the run ends failed"
            )
            log.warning("run %s: %s", self.run_id, warning)
        cp.restart_node = node_id
        await self.writer.write_checkpoint(cp)
        return Failed(
            node.code, message, node=node_id, deliberate=True, resumable=False, warning=warning
        )

    async def _stop_for_cancel(self, node_id: str) -> Outcome:
        reason = self.cancel.reason
        if reason is CancelReason.LEASE_LOST or reason is None:
            return Interrupted(CancelReason.LEASE_LOST)
        self.checkpoint.restart_node = node_id
        await self.writer.write_checkpoint(self.checkpoint)
        if reason is CancelReason.OPERATOR:
            return Cancelled()
        return Interrupted(reason)
