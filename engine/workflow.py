"""The workflow file's model (SPEC §6.1): pydantic, validated once at load, immutable after.

Only the *shape* is checked here; cross-field rules that need the whole graph (an edge's target
exists, a fail node's code is not an engine code, expressions and templates compile) are the
loader's, because it knows the line of every value and can say where a problem is.

Names that expressions reach by attribute (`outputs.<node>.<field>`, `vars.<name>`,
`loop.<name>`, `answers.<question>`) must be identifiers that do not start with `_`: the
expression language refuses underscore attributes, so such a name could never be read.
"""

from __future__ import annotations

import math
import re
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from store.models import Budget

_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_BOT_CODE = re.compile(r"[A-Z][A-Z0-9_]*")
_FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_DRIVER = re.compile(r"[a-z][a-z0-9_-]*")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any) -> Any:
    """Seconds from `30`, `2.5`, `"30"`, `"30s"`, `"5m"`, `"1h30m"`, `"250ms"`.

    Anything else is handed on unchanged for pydantic to refuse with its own message, except a
    bool (YAML's `yes`), which would otherwise pass as 1 second.
    """
    if isinstance(value, bool):
        raise ValueError("expected a duration like 30, '30s', '5m' or '1h', got a bool")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    compact = text.replace(" ", "")
    parts = _DURATION_PART.findall(compact)
    if not parts or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"expected a duration like 30, '30s', '5m' or '1h', got {value!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _identifier(kind: str) -> AfterValidator:
    def check(value: str) -> str:
        if not _IDENT.fullmatch(value):
            raise ValueError(
                f"{kind} {value!r} must be an identifier (a letter, then letters, digits or _)"
                " so expressions can name it"
            )
        return value

    return AfterValidator(check)


def _matches(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


Seconds = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_finite)]
"""A duration in seconds; accepts plain numbers and `30s` / `5m` / `1h` strings."""
Timeout = Annotated[Seconds, Field(gt=0)]
NodeId = Annotated[str, _identifier("node id")]
VarName = Annotated[str, _identifier("var name")]
FieldName = Annotated[str, _identifier("name")]
NonEmpty = Annotated[str, Field(min_length=1)]

VarType = Literal["string", "bool", "int", "number"]
QuestionType = Literal["string", "bool", "int", "number", "file"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RetrySpec(_Model):
    """In-process retries of a transient node-level failure (SPEC §6.6)."""

    max: int = Field(default=2, ge=0, le=20)
    """Retries after the first try (0 disables them)."""
    backoff: Annotated[Seconds, Field(gt=0)] = 1.0
    """Delay before the first retry; doubled for each next one."""


class ToolNode(_Model):
    """A shell command run in the sandbox; `{{ }}` values are shell-quoted unless `| raw`."""

    kind: Literal["tool"]
    run: NonEmpty
    timeout: Timeout = 600.0
    output: Literal["text", "json"] = "text"
    retry: RetrySpec | None = None


class ComputeNode(_Model):
    """Safe expressions evaluated in the engine; the output is the dict of their values."""

    kind: Literal["compute"]
    set: Annotated[dict[FieldName, NonEmpty], Field(min_length=1)]
    retry: RetrySpec | None = None


class Question(_Model):
    name: FieldName
    type: QuestionType
    required: bool = True
    description: str = ""


class HumanNode(_Model):
    """Typed questions for a person; the run pauses until a resume answers them."""

    kind: Literal["human"]
    questions: Annotated[list[Question], Field(min_length=1)]
    message: str = ""


class CallNode(_Model):
    """An async Python callable `pkg.module:func(ctx, inputs) -> dict` (the seam, §6.1)."""

    kind: Literal["call"]
    function: Annotated[str, _matches(_FUNCTION, "a callable reference like 'pkg.module:func'")]
    inputs: dict[str, Any] = Field(default_factory=dict)
    """Values may be templates; they are rendered (unquoted) before the call."""
    timeout: Timeout = 600.0
    retry: RetrySpec | None = None


class FailNode(_Model):
    """A deliberate failure with the workflow's own code (SPEC §6.5)."""

    kind: Literal["fail"]
    code: Annotated[str, _matches(_BOT_CODE, "an upper-case code like BUDGET_GUARD")]
    message: str = ""
    resumable: bool = False


Node = Annotated[
    ToolNode | ComputeNode | HumanNode | CallNode | FailNode, Field(discriminator="kind")
]
SANDBOX_KINDS: frozenset[str] = frozenset({"tool", "call"})
"""Node kinds that run in (or next to) the sandbox; `compute`, `human`, `fail` never do."""


class LoopSpec(_Model):
    name: FieldName
    max: int = Field(ge=1)


class Edge(_Model):
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_alias=True, validate_by_name=True
    )

    from_: NodeId = Field(alias="from")
    to: NodeId
    when: NonEmpty | None = None
    loop: LoopSpec | None = None


class VarSpec(_Model):
    type: VarType = "string"
    default: str | bool | int | float | None = None
    description: str = ""

    @model_validator(mode="after")
    def _default_fits_type(self) -> VarSpec:
        if self.default is not None and not value_fits(self.type, self.default):
            raise ValueError(f"default {self.default!r} is not of type {self.type}")
        return self


class WorkflowBudget(_Model):
    max_duration: Annotated[Seconds, Field(gt=0)] | None = None
    max_iterations: int | None = Field(default=None, ge=1)
    max_cost_usd: float | None = Field(default=None, ge=0)

    def to_store(self) -> Budget:
        return Budget(
            max_duration=self.max_duration,
            max_iterations=self.max_iterations,
            max_cost_usd=self.max_cost_usd,
        )


class SandboxSpec(_Model):
    driver: Annotated[str, _matches(_DRIVER, "a driver name like 'local'")] | None = None
    """`None`: the runner's `RUNFLEET_SANDBOX` (itself default `local`). The file wins."""
    options: dict[str, Any] = Field(default_factory=dict)


class Workflow(_Model):
    name: NonEmpty
    description: str = ""
    entry: NodeId
    nodes: Annotated[dict[NodeId, Node], Field(min_length=1)]
    vars: dict[VarName, VarSpec] = Field(default_factory=dict)
    budget: WorkflowBudget = Field(default_factory=WorkflowBudget)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    edges: list[Edge] = Field(default_factory=list)

    @cached_property
    def _leaving(self) -> dict[str, list[Edge]]:
        """Edges by the node they leave, in file order: built once, so walking a graph is
        linear in its edges (a scale drill: each step scanned every edge, and a 5 000-node
        chain took 3 minutes in-process)."""
        by_node: dict[str, list[Edge]] = {}
        for edge in self.edges:
            by_node.setdefault(edge.from_, []).append(edge)
        return by_node

    @cached_property
    def _entering(self) -> dict[str, list[str]]:
        by_node: dict[str, list[str]] = {}
        for edge in self.edges:
            by_node.setdefault(edge.to, []).append(edge.from_)
        return by_node

    def outgoing(self, node_id: str) -> list[Edge]:
        """Edges leaving `node_id`, in file order (the order `when`s are evaluated in)."""
        return list(self._leaving.get(node_id, ()))

    def predecessors(self, node_id: str) -> list[str]:
        """Distinct nodes with an edge into `node_id`, in file order."""
        return list(dict.fromkeys(self._entering.get(node_id, ())))

    def successors(self, node_id: str) -> set[str]:
        return {e.to for e in self._leaving.get(node_id, ())}

    def guard_of(self, node_id: str) -> str | None:
        """The single predecessor a resumable fail node anchors on (SPEC §6.5), or `None`.

        `None` when the node is the entry or several nodes lead into it: no one guard owns
        the refusal, and the run ends `failed` instead of parking.
        """
        preds = self.predecessors(node_id)
        if node_id == self.entry or len(preds) != 1:
            return None
        return preds[0]

    def loops(self) -> dict[str, int]:
        """Loop name → its `max` (the loader refuses one name with two maxima)."""
        return {e.loop.name: e.loop.max for e in self.edges if e.loop is not None}


def value_fits(type_: str, value: Any) -> bool:
    """Whether a typed (JSON) value is a `type_`; bools are never numbers here."""
    if type_ == "string":
        return isinstance(value, str)
    if type_ == "bool":
        return isinstance(value, bool)
    if type_ == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_ == "number":
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an int past the float range (JSON `1e400` written out)
            return False
    return False
