"""What an operator does about a failure code (docs/workflows.md "Failure codes and what to do
about each", shortened for the console's run page). A code not listed is the workflow's own
(`fail` node): its message says why."""

from __future__ import annotations

_BY_CODE: dict[str, str] = {
    "TOOL_FAILED_TRANSIENT": "Nothing while it retries; if it keeps failing, read the node's"
    " stderr in the timeline, fix the cause, then resume.",
    "TIMEOUT": "If it recurs, raise the node's timeout (resume with an edited workflow) or fix"
    " what hangs.",
    "EXECUTION_FAILED": "Read the error; fix the callable's bug, restart the runners, resume.",
    "RATE_LIMITED": "Nothing; if it parks, wait for the quota and resume.",
    "NETWORK_TRANSIENT": "Check connectivity from the runners; resume once it is back.",
    "SANDBOX_SETUP_TIMEOUT": "Check the sandbox backend's health; it retries by itself.",
    "SANDBOX_CAPACITY": "Add capacity or runners with room; it retries by itself.",
    "SANDBOX_LOST": "Check the runner's host (OOM, disk); it retries by itself.",
    "ATTACHMENTS_UNFETCHABLE": "Check the blob store (RUNFLEET_BLOB_URL) is reachable; if the run"
    " waits at its question, the uploaded file is gone: answer again with a new upload.",
    "SCRATCH_RESTORE_FAILED": "Check the blob store; if the bank is gone, resume accepting"
    " the scratch loss.",
    "RUNNER_INTERRUPTED": "Nothing: another runner continues it.",
    "RUNNER_LOST": "Nothing: it is republished; look at why the runner died.",
    "INTERNAL_ERROR": "Read the runner's log; report it if it recurs.",
    "DLQ_PARKED": "Fix the cause named by the cause code, then resume (or replay its DLQ record).",
    "SCRATCH_NOT_PORTABLE": "Resume accepting the scratch loss to continue without it.",
    "AMBIGUOUS_EFFECT": "Check the remote side; if the effect happened, rewind past the node or"
    " finish by hand; else resume.",
    "BUDGET_EXCEEDED": "Resume with a raised cap (iterations, duration, cost), or cancel.",
    "EXPRESSION_FAILED": "Fix the workflow; rewind to the node with the fixed file, then"
    " resume — or launch again.",
    "TOOL_FAILED_PERMANENT": "Read stderr in the timeline; fix, rewind to the node, resume — or"
    " launch again.",
    "SCHEMA_VALIDATION": "Fix the tool or callable; rewind and resume.",
    "NO_OUTGOING_EDGE": "Add a default edge (no `when`) last; rewind with the file, resume.",
    "LOOP_EXHAUSTED": "Add an exit edge or raise `max`; rewind with the file, resume.",
    "WORKFLOW_INVALID": "`runfleet validate` the file; fix it or the runner's PYTHONPATH;"
    " rewind with the file, resume.",
    "OUTPUT_TOO_LARGE": "Write big results to a file (the scratch) and output its path.",
    "ATTACHMENTS_UNDELIVERABLE": "Run it with a sandbox driver that can deliver files.",
    "ATTACHMENT_PATH_UNAVAILABLE": "Fix the node or the sandbox driver.",
    "SANDBOX_IMAGE_INVALID": "Fix sandbox.options; launch again.",
    "SANDBOX_START_FAILED": "Fix the driver's configuration; launch again.",
    "LAUNCH_FAILED": "Fix the cause; launch again.",
}


_BOT = (
    "The workflow refused on purpose (its own code): act on its message; resume it if it is"
    " failed_resumable, else launch again."
)


def what_to_do(code: str | None) -> str | None:
    """The advice for `code`, or None when the run has no failure code."""
    if code is None:
        return None
    return _BY_CODE.get(code, _BOT)
