"""Typed refusals of a resume or a rewind (SPEC §4, §6.7, §10: CLI exit code 3).

Each has a stable `code` and a `remedy` (a class attribute, but for `ScratchNotPortable`, whose
remedy names the consents this case needs); the resume refusals are raised in the order SPEC §4
lists them, so the first thing a person must fix is the first thing they are told.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from store import Refusal

NEXT_STEP: dict[str, str] = {
    "finished": "a finished run is done: it is neither resumed nor rewound (SPEC §6.7); launch"
    " the workflow again for a new run (`runfleet launch FILE`)",
    "failed": "rewind it to a node before the failure (`runfleet rewind RUN --node NODE`),"
    " then resume it",
    "queued": "it is already queued: follow it with `runfleet events RUN --follow`, or cancel"
    " it (`runfleet cancel RUN`) first",
    "running, no runner holds it": "no runner holds it (its lease expired or was released):"
    " the sweeper republishes such a run within its interval plus its grace (≈ 90 s); if it"
    " stays so, `runfleet cancel RUN` then `runfleet resume RUN` runs it again from its"
    " checkpoint",
    "running": "it is already running: follow it with `runfleet events RUN --follow`, or cancel"
    " it (`runfleet cancel RUN`) first",
}
"""What an operator can do with a run that an operation refused for its status: one answer
per status, shared by the resume and the rewind refusals so the two never contradict."""


LAPSED = timedelta(seconds=10)
"""How long past its expiry a lease must be before a run `running` under it is called held by
no runner (`resume`'s refusal, `status`'s next line): more than any skew between hosts, so a
live lease read on a clock a little ahead is not called lapsed (and its run cancelled on that
advice; a review)."""


def next_step(status: str) -> str:
    """The remedy for a run refused because of its `status` (which may carry a note)."""
    for name, step in NEXT_STEP.items():
        if status.startswith(name):
            return step
    return "check `runfleet status RUN` and retry"


class RunNotResumable(Refusal, code="run_not_resumable"):
    """Only paused, failed_resumable or cancelled runs resume (SPEC §4)."""

    def __init__(self, run_id: str, status: str) -> None:
        super().__init__(
            f"run {run_id} is {status}: only paused, failed_resumable or cancelled runs resume",
            remedy=next_step(str(status)),
        )


class ScratchNotPortable(Refusal, code="scratch_not_portable"):
    """The run's scratch cannot follow it to a new execution without consent."""

    def __init__(self, run_id: str, why: str, *, also_needs_force: bool = False) -> None:
        consents = "--accept-scratch-loss" + (" and --force" if also_needs_force else "")
        super().__init__(
            f"run {run_id}: its scratch cannot follow it ({why})",
            remedy=f"resume with {consents} to continue without the scratch",
        )
        self.run_id = run_id
        self.why = why
        self.also_needs_force = also_needs_force

    def naming(self, cause: str) -> ScratchNotPortable:
        """The same refusal with what refused the bank named (the blob store's answer, kept
        only in the `sandbox_scratch_banked` event the teardown wrote)."""
        return ScratchNotPortable(
            self.run_id, f"{self.why}: {cause}", also_needs_force=self.also_needs_force
        )

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        if self.also_needs_force:
            out["also_needs_force"] = True
        return out


class WorkflowSourceChanged(Refusal, code="workflow_source_changed"):
    """The workflow file given differs from the source the run carries."""

    remedy = "resume with --force to swap the source in, or omit --file"

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id}: the given workflow file differs from the run's source")


class SourceLacksRestartNode(Refusal, code="source_lacks_restart_node"):
    """A forced new source without the node the run restarts at (or the question it waits
    on): the swapped-in workflow could not continue the run."""

    remedy = "keep that node in the new workflow file, or rewind the run to a node it keeps"

    def __init__(self, run_id: str, node: str, why: str) -> None:
        super().__init__(f"run {run_id}: the new workflow {why} {node!r}, where the run restarts")


class BudgetBelowConsumed(Refusal, code="budget_below_consumed"):
    """A new budget cap below what the run has already consumed."""

    remedy = "raise the cap above the consumed amount shown by `runfleet status RUN`"

    def __init__(self, run_id: str, fields: Sequence[str]) -> None:
        super().__init__(
            f"run {run_id}: new cap below what is already consumed: {', '.join(fields)}"
        )


class RunBusy(Refusal, code="run_busy"):
    """An execution still holds the run's lease."""

    remedy = "wait for the execution to stop (or cancel it), then retry"

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id}: an execution still holds its lease")


class RewindRefused(Refusal, code="rewind_refused"):
    """The run cannot be rewound to that node now; the message says why."""

    remedy = "pick a node the run reached (`runfleet status RUN` lists their outputs)"
