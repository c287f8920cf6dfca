"""The engine's errors, in the one tree rooted at `store.errors.RunfleetError`
(drawn, with every code, in that module's docstring).

Errors that end a node carry `failure_code`, the row of the failure table they map to, so the
executor never decides a failure's class from its message. The exceptions a `call` node's
callable raises (`Transient`, `Permanent`, `AmbiguousEffect`) live in `engine.call_errors` and
are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from engine.call_errors import AmbiguousEffect, CallError, Permanent, Transient
from engine.failures import FailureCode
from store.errors import Refusal, RunfleetError

__all__ = [
    "AmbiguousEffect",
    "AnswersInvalid",
    "AnswersRequired",
    "CallError",
    "ExpressionError",
    "Permanent",
    "Problem",
    "TemplateError",
    "Transient",
    "WorkflowInvalid",
]


@dataclass(frozen=True, slots=True)
class Problem:
    """One load error: where it is and what is wrong."""

    field: str
    line: int
    message: str


class WorkflowInvalid(RunfleetError, code="workflow_invalid"):
    """A workflow file that does not load. `str()` reads `file:line: field: message`.

    When several problems were found, the first (by line) is the message and all of them are
    in `problems`, so a CLI can list every one in a single pass.
    """

    remedy = (
        "fix the workflow file at the line shown and load it again (`runfleet validate FILE`"
        " lists every problem at once)"
    )
    failure_code: ClassVar[FailureCode] = FailureCode.WORKFLOW_INVALID

    def __init__(
        self,
        file: str,
        field: str,
        line: int,
        message: str,
        *,
        problems: Sequence[Problem] = (),
    ) -> None:
        self.file = file
        self.field = field
        self.line = line
        self.detail = message
        self.problems: tuple[Problem, ...] = tuple(problems) or (Problem(field, line, message),)
        where = f"{field}: " if field else ""
        super().__init__(f"{file}:{line}: {where}{message}")


class ExpressionError(RunfleetError, code="expression_failed"):
    """An expression that does not parse, refers to what is not there, or raised."""

    failure_code: ClassVar[FailureCode] = FailureCode.EXPRESSION_FAILED

    def __init__(self, expression: str, message: str) -> None:
        self.expression = expression
        self.detail = message
        super().__init__(f"expression {expression!r}: {message}")


class TemplateError(RunfleetError, code="template_failed"):
    """A template that does not compile or render; names the template text."""

    failure_code: ClassVar[FailureCode] = FailureCode.EXPRESSION_FAILED

    def __init__(self, template: str, message: str, *, lineno: int | None = None) -> None:
        self.template = template
        self.detail = message
        self.lineno = lineno
        shown = template if len(template) <= 200 else template[:197] + "..."
        super().__init__(f"template {shown!r}: {message}")


class AnswersRequired(Refusal, code="answers_required"):
    """A run paused on a question was resumed without answers."""

    remedy = "pass the answers with --answer NAME=VALUE or --answers-file FILE"

    def __init__(self, missing: Sequence[str], *, any_of: bool = False) -> None:
        self.missing = tuple(missing)
        self.any_of = any_of
        names = ", ".join(self.missing)
        super().__init__(
            f"at least one answer required (all optional): {names}"
            if any_of
            else f"answers required: {names}"
        )


class AnswersInvalid(Refusal, code="answers_invalid"):
    """An answer that does not fit its question's schema; `field` names the (first) question,
    `problems` every wrong answer with what is wrong with it."""

    remedy = "correct the named answer and resume again"

    def __init__(self, field: str, message: str, *, remedy: str | None = None) -> None:
        self.field = field
        self.detail = message
        self.problems: tuple[tuple[str, str], ...] = ((field, message),)
        super().__init__(f"answer {field!r}: {message}", remedy=remedy)

    @classmethod
    def every(cls, found: Sequence[AnswersInvalid]) -> AnswersInvalid:
        """One refusal naming every wrong answer: naming only the first of several sent the
        person back once per mistake (a newcomer's walkthrough)."""
        if len(found) == 1:
            return found[0]
        first = found[0]
        # One remedy of its own that every part shares is kept; else the plural of the class's.
        remedies = {f.remedy for f in found}
        shared = remedies.pop() if len(remedies) == 1 else cls.remedy
        combined = cls(
            first.field,
            first.detail,
            remedy="correct the named answers and resume again" if shared == cls.remedy else shared,
        )
        combined.problems = tuple(p for f in found for p in f.problems)
        combined.message = "; ".join(f"answer {name!r}: {what}" for name, what in combined.problems)
        combined.args = (combined.message,)
        return combined
