"""What a `call` node's Python callable raises to say how it failed (SPEC §6.1).

These are plain exceptions, not `RunfleetError`s: they are the seam's vocabulary for code
written outside runfleet (agents, integrations), and the engine translates them into a failure
code at the one place it awaits the callable. Any other exception from a callable is
`EXECUTION_FAILED`.

    Transient(code)     worth retrying: the node's in-process retries, then a nak
    Permanent(code)     the same call would fail again: terminal
    AmbiguousEffect     the call may have changed remote state and lost its answer: parked
                        `AMBIGUOUS_EFFECT` for a person to reconcile; never retried blindly
"""

from __future__ import annotations

from engine.failures import FailureCode, is_engine_code


def _normalise(code: FailureCode | str) -> FailureCode | str:
    if isinstance(code, FailureCode):
        return code
    return FailureCode(code) if is_engine_code(code) else code


class CallError(Exception):
    """Base of the call-node failures; `code` is an engine `FailureCode` or a bot string."""

    def __init__(self, code: FailureCode | str, message: str = "") -> None:
        self.code: FailureCode | str = _normalise(code)
        self.message = message or str(self.code)
        super().__init__(self.message)


class Transient(CallError):
    """A failure a retry may cure, e.g. `Transient(FailureCode.RATE_LIMITED, "429")`."""

    def __init__(
        self, code: FailureCode | str = FailureCode.EXECUTION_FAILED, message: str = ""
    ) -> None:
        super().__init__(code, message)


class Permanent(CallError):
    """A failure every retry would repeat, e.g. `Permanent("INVALID_TICKET", "no such id")`."""

    def __init__(
        self, code: FailureCode | str = FailureCode.TOOL_FAILED_PERMANENT, message: str = ""
    ) -> None:
        super().__init__(code, message)


class AmbiguousEffect(CallError):
    """The request left, and whether the remote side applied it is unknown."""

    def __init__(self, message: str = "") -> None:
        super().__init__(FailureCode.AMBIGUOUS_EFFECT, message)
