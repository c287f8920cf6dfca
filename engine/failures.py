"""Failure codes and their classification: one enum, one table (SPEC §6.6).

Retry is decided from data, never by matching error messages: the runner's disposition, the
sweeper and `runfleet resume --local --auto-resume N` read only `RULES` (through `rule_for`,
`is_auto_resumable` and `nak_delay`). A test enumerates `FailureCode` against `RULES`, so a code
added to the enum without a row fails CI instead of being silently treated as anything.

Bot codes (the `code` of a `fail` node) are any other string. They are never auto-resumed
(SPEC §6.5, §13.8): the workflow refused on purpose, and only an operator can change the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from store.models import RunStatus


class FailureCode(StrEnum):
    """Every failure code the engine itself writes to `failure_code`."""

    # transient, node-level
    EXECUTION_FAILED = "EXECUTION_FAILED"
    TIMEOUT = "TIMEOUT"
    RATE_LIMITED = "RATE_LIMITED"
    NETWORK_TRANSIENT = "NETWORK_TRANSIENT"
    TOOL_FAILED_TRANSIENT = "TOOL_FAILED_TRANSIENT"
    # transient, infrastructure
    SANDBOX_SETUP_TIMEOUT = "SANDBOX_SETUP_TIMEOUT"
    SANDBOX_CAPACITY = "SANDBOX_CAPACITY"
    SANDBOX_LOST = "SANDBOX_LOST"
    ATTACHMENTS_UNFETCHABLE = "ATTACHMENTS_UNFETCHABLE"
    SCRATCH_RESTORE_FAILED = "SCRATCH_RESTORE_FAILED"
    RUNNER_INTERRUPTED = "RUNNER_INTERRUPTED"
    RUNNER_LOST = "RUNNER_LOST"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    # operator-resumable
    DLQ_PARKED = "DLQ_PARKED"
    SCRATCH_NOT_PORTABLE = "SCRATCH_NOT_PORTABLE"
    AMBIGUOUS_EFFECT = "AMBIGUOUS_EFFECT"
    # budget
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"
    # deterministic
    EXPRESSION_FAILED = "EXPRESSION_FAILED"
    TOOL_FAILED_PERMANENT = "TOOL_FAILED_PERMANENT"
    SCHEMA_VALIDATION = "SCHEMA_VALIDATION"
    NO_OUTGOING_EDGE = "NO_OUTGOING_EDGE"
    LOOP_EXHAUSTED = "LOOP_EXHAUSTED"
    WORKFLOW_INVALID = "WORKFLOW_INVALID"
    OUTPUT_TOO_LARGE = "OUTPUT_TOO_LARGE"
    ATTACHMENTS_UNDELIVERABLE = "ATTACHMENTS_UNDELIVERABLE"
    ATTACHMENT_PATH_UNAVAILABLE = "ATTACHMENT_PATH_UNAVAILABLE"
    SANDBOX_IMAGE_INVALID = "SANDBOX_IMAGE_INVALID"
    SANDBOX_START_FAILED = "SANDBOX_START_FAILED"
    LAUNCH_FAILED = "LAUNCH_FAILED"


class FailureClass(StrEnum):
    TRANSIENT_NODE = "transient_node"
    """Retried in-process first, then nak'd with the code's delay; auto-resumed."""
    TRANSIENT_INFRA = "transient_infra"
    """Needs a new execution: no in-process retry; nak'd with the code's delay; auto-resumed."""
    OPERATOR_RESUMABLE = "operator_resumable"
    """Parked `failed_resumable` for a person; never auto-resumed."""
    BUDGET = "budget"
    """Parked `paused_operator`; the operator raises the cap."""
    DETERMINISTIC = "deterministic"
    """Terminal `failed`: every attempt would reach the same verdict."""


TRANSIENT_CLASSES: frozenset[FailureClass] = frozenset(
    {FailureClass.TRANSIENT_NODE, FailureClass.TRANSIENT_INFRA}
)

DEFAULT_NODE_RETRIES = 2
"""In-process retries of a transient node-level failure when the node declares no `retry`."""


@dataclass(frozen=True, slots=True)
class CodeRule:
    """One row of the table: what a failure code means to the machinery."""

    code: str
    klass: FailureClass
    status: RunStatus
    fixed_delay_s: float | None
    """A nak delay that does not follow the ladder (transient codes only)."""
    node_retries: int
    """In-process retries before the failure leaves the node (transient node-level only)."""

    @property
    def transient(self) -> bool:
        return self.klass in TRANSIENT_CLASSES


def _row(
    code: FailureCode,
    klass: FailureClass,
    *,
    fixed_delay_s: float | None = None,
) -> tuple[FailureCode, CodeRule]:
    status = {
        FailureClass.TRANSIENT_NODE: RunStatus.FAILED_RESUMABLE,
        FailureClass.TRANSIENT_INFRA: RunStatus.FAILED_RESUMABLE,
        FailureClass.OPERATOR_RESUMABLE: RunStatus.FAILED_RESUMABLE,
        FailureClass.BUDGET: RunStatus.PAUSED_OPERATOR,
        FailureClass.DETERMINISTIC: RunStatus.FAILED,
    }[klass]
    retries = DEFAULT_NODE_RETRIES if klass is FailureClass.TRANSIENT_NODE else 0
    return code, CodeRule(code, klass, status, fixed_delay_s, retries)


_C = FailureCode
_K = FailureClass

RULES: dict[FailureCode, CodeRule] = dict(
    [
        _row(_C.EXECUTION_FAILED, _K.TRANSIENT_NODE),
        _row(_C.TIMEOUT, _K.TRANSIENT_NODE),
        _row(_C.RATE_LIMITED, _K.TRANSIENT_NODE),
        _row(_C.NETWORK_TRANSIENT, _K.TRANSIENT_NODE),
        _row(_C.TOOL_FAILED_TRANSIENT, _K.TRANSIENT_NODE),
        _row(_C.SANDBOX_SETUP_TIMEOUT, _K.TRANSIENT_INFRA, fixed_delay_s=120.0),
        _row(_C.SANDBOX_CAPACITY, _K.TRANSIENT_INFRA, fixed_delay_s=300.0),
        _row(_C.SANDBOX_LOST, _K.TRANSIENT_INFRA),
        _row(_C.ATTACHMENTS_UNFETCHABLE, _K.TRANSIENT_INFRA, fixed_delay_s=120.0),
        _row(_C.SCRATCH_RESTORE_FAILED, _K.TRANSIENT_INFRA),
        _row(_C.RUNNER_INTERRUPTED, _K.TRANSIENT_INFRA),
        _row(_C.RUNNER_LOST, _K.TRANSIENT_INFRA),
        _row(_C.INTERNAL_ERROR, _K.TRANSIENT_INFRA),
        _row(_C.DLQ_PARKED, _K.OPERATOR_RESUMABLE),
        _row(_C.SCRATCH_NOT_PORTABLE, _K.OPERATOR_RESUMABLE),
        _row(_C.AMBIGUOUS_EFFECT, _K.OPERATOR_RESUMABLE),
        _row(_C.BUDGET_EXCEEDED, _K.BUDGET),
        _row(_C.EXPRESSION_FAILED, _K.DETERMINISTIC),
        _row(_C.TOOL_FAILED_PERMANENT, _K.DETERMINISTIC),
        _row(_C.SCHEMA_VALIDATION, _K.DETERMINISTIC),
        _row(_C.NO_OUTGOING_EDGE, _K.DETERMINISTIC),
        _row(_C.LOOP_EXHAUSTED, _K.DETERMINISTIC),
        _row(_C.WORKFLOW_INVALID, _K.DETERMINISTIC),
        _row(_C.OUTPUT_TOO_LARGE, _K.DETERMINISTIC),
        _row(_C.ATTACHMENTS_UNDELIVERABLE, _K.DETERMINISTIC),
        _row(_C.ATTACHMENT_PATH_UNAVAILABLE, _K.DETERMINISTIC),
        _row(_C.SANDBOX_IMAGE_INVALID, _K.DETERMINISTIC),
        _row(_C.SANDBOX_START_FAILED, _K.DETERMINISTIC),
        _row(_C.LAUNCH_FAILED, _K.DETERMINISTIC),
    ]
)


_ENGINE_CODES: frozenset[str] = frozenset(c.value for c in FailureCode)


def is_engine_code(code: str) -> bool:
    """True when `code` is one of the engine's own codes (a bot code may not be one)."""
    return code in _ENGINE_CODES


def rule_for(code: str, *, bot_resumable: bool | None = None) -> CodeRule:
    """The rule for `code`; any string that is not an engine code is a bot code.

    A bot code is operator-resumable (`failed_resumable`) when its fail node said `resumable:
    true`, else deterministic (`failed`). Either way it is never auto-resumed: an unattended
    retry would only meet the same guard again. `bot_resumable` is ignored for engine codes.
    """
    if is_engine_code(code):
        return RULES[FailureCode(code)]
    if bot_resumable:
        return CodeRule(code, FailureClass.OPERATOR_RESUMABLE, RunStatus.FAILED_RESUMABLE, None, 0)
    return CodeRule(code, FailureClass.DETERMINISTIC, RunStatus.FAILED, None, 0)


def is_auto_resumable(code: str | None) -> bool:
    """Whether machinery (redelivery, sweeper, `--auto-resume`) may resume a run with `code`."""
    if code is None:
        return False
    return rule_for(code).transient


def nak_delay(code: str, delivery: int, base_s: float = 5.0, cap_s: float = 600.0) -> float:
    """Seconds to wait before the next delivery after a transient failure (SPEC §5.5).

    `delivery` is the 1-based delivery that failed; `base_s` is `RUNFLEET_TRANSIENT_DELAY`.
    Codes with a fixed delay (capacity, setup, attachments) ignore the ladder: retrying a full
    cluster sooner does not make it emptier. Raises `ValueError` for a code that is not
    transient: such a failure is acked, never nak'd, and asking for its delay is a bug.
    """
    if delivery < 1:
        raise ValueError(f"delivery is 1-based, got {delivery}")
    rule = rule_for(code)
    if not rule.transient:
        raise ValueError(f"{code} is {rule.klass}: it is never nak'd with a delay")
    if rule.fixed_delay_s is not None:
        return rule.fixed_delay_s
    # min() on the exponent first keeps 2**n finite for absurd delivery counts.
    return min(cap_s, base_s * 2.0 ** min(delivery - 1, 64))


def node_retry_backoff(retry_index: int, base_s: float = 1.0, cap_s: float = 60.0) -> float:
    """Seconds to sleep before in-process retry number `retry_index` (1-based) of a node.

    Doubling from `base_s` (1 s by default, or the node's `retry.backoff`), capped at `cap_s`.
    """
    if retry_index < 1:
        raise ValueError(f"retry_index is 1-based, got {retry_index}")
    return min(cap_s, base_s * 2.0 ** min(retry_index - 1, 64))


def node_retries_for(code: str, declared: int | None = None) -> int:
    """How many in-process retries a node gets for `code`: its `retry.max` or the table's.

    Only transient node-level codes are retried in-process; a node's `retry` cannot make an
    infrastructure or deterministic failure retry inside the same execution.
    """
    rule = rule_for(code)
    if rule.klass is not FailureClass.TRANSIENT_NODE:
        return 0
    return rule.node_retries if declared is None else declared
