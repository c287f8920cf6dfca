"""Resolving a run's `vars` (SPEC §6.1): declared defaults overlaid with the launch's `--var`
values, coerced to each declared type. Resolved once, then kept in the checkpoint."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from engine.workflow import Workflow, value_fits
from store import Refusal

_TRUE = {"true", "yes", "1"}
_FALSE = {"false", "no", "0"}


class VarsInvalid(Refusal, code="vars_invalid"):
    """A `--var` the workflow does not declare, of the wrong type, or a required one not given."""

    remedy = "pass --var name=value for the workflow's declared vars (see its `vars:`)"

    def __init__(self, name: str, message: str, *, remedy: str | None = None) -> None:
        super().__init__(f"var {name!r}: {message}", remedy=remedy)
        self.field = name


def _coerce(name: str, type_: str, value: Any) -> Any:
    # A `number` is finite and within the float range (`value_fits`): `1e999` (inf), `nan` and
    # a 400-digit int are refused, not carried into expressions as inf or an overflow.
    if value_fits(type_, value):
        return value
    if isinstance(value, str):
        text = value.strip()
        if type_ == "string":
            return value
        if type_ == "bool" and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        try:
            if type_ == "int" and re.fullmatch(r"[+-]?\d+", text):
                return int(text)
            if type_ == "number":
                number = float(text) if any(c in text for c in ".eE") else int(text)
                if value_fits("number", number):
                    return number
        except ValueError:  # not a number, or past Python's int/str limit (4300 digits)
            pass
    raise VarsInvalid(name, f"expected {type_}, got {_shown(value)}")


def _shown(value: Any) -> str:
    try:
        shown = repr(value)
    except ValueError:  # an int too long to print
        return f"{type(value).__name__} (too long to show)"
    return shown if len(shown) <= 200 else shown[:197] + "..."


MAX_VARS_BYTES = 1024 * 1024
"""The most a launch's vars may hold, as JSON. Vars live in the run document and in every
checkpoint write: a scale drill's 50 MB var took a runner to 1.2 GB, and a 10 MB one made a
200-iteration loop 65 s instead of 1 s. A large value belongs in an attachment or a file."""


def resolve_vars(
    workflow: Workflow, inputs: Mapping[str, Any], *, at_launch: bool = True
) -> dict[str, Any]:
    """`inputs` checked against the declared vars, with defaults filled in. `at_launch`: also
    refuse vars over `MAX_VARS_BYTES` (a run launched before the bound is not refused later)."""
    if at_launch:
        sizes = {name: len(json.dumps(value, default=str)) for name, value in inputs.items()}
        if sum(sizes.values()) > MAX_VARS_BYTES:
            largest = max(sizes, key=sizes.__getitem__)
            raise VarsInvalid(
                largest,
                f"is {sizes[largest]} bytes as JSON; a launch's vars may hold {MAX_VARS_BYTES}",
                remedy="pass a large value as an attachment and read it from its path"
                " (docs/workflows.md, Attachments)",
            )
    for name in inputs:
        if name not in workflow.vars:
            declared = ", ".join(workflow.vars) or "none"
            raise VarsInvalid(name, f"not declared by workflow {workflow.name!r} ({declared})")
    out: dict[str, Any] = {}
    for name, spec in workflow.vars.items():
        if name in inputs:
            if isinstance(inputs[name], str) and "\x00" in inputs[name]:  # not at a tool node
                raise VarsInvalid(name, "holds a NUL byte, which no command line can carry")
            out[name] = _coerce(name, spec.type, inputs[name])
        elif spec.default is not None:
            out[name] = spec.default
        else:
            raise VarsInvalid(name, "required (no default) and not given")
    return out
