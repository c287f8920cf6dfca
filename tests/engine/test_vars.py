"""Resolving `vars` (SPEC §6.1): a bad `--var` is `VarsInvalid` naming the var, never untyped."""

from __future__ import annotations

from typing import Any

import pytest

from engine.loader import load_workflow
from engine.vars import VarsInvalid, resolve_vars
from engine.workflow import Workflow

TEXT = """\
name: v
entry: a
vars:
  count: {type: int, default: 1}
  ratio: {type: number, default: 0.5}
nodes:
  a: {kind: compute, set: {x: "vars.count"}}
"""


@pytest.fixture
def workflow() -> Workflow:
    return load_workflow(TEXT, "v.yaml").workflow


def test_vars_are_coerced_to_their_declared_type(workflow: Workflow) -> None:
    assert resolve_vars(workflow, {"count": "7", "ratio": "2.5"}) == {"count": 7, "ratio": 2.5}
    assert resolve_vars(workflow, {"ratio": "3"}) == {"count": 1, "ratio": 3}


@pytest.mark.parametrize("name", ["count", "ratio"])
def test_a_var_past_the_int_digit_limit_is_refused_typed(workflow: Workflow, name: str) -> None:
    # 5000 digits is past Python's int/str conversion limit: `int()` raises ValueError
    with pytest.raises(VarsInvalid) as info:
        resolve_vars(workflow, {name: "9" * 5000})
    assert info.value.field == name
    assert len(str(info.value)) < 500


@pytest.mark.parametrize(
    "value",
    [
        "1e999",
        "-1e999",
        "inf",
        "nan",
        pytest.param("1" + "0" * 400, id="400-digit-text"),
        pytest.param(10**400, id="400-digit-int"),
    ],
)
def test_a_non_finite_number_var_is_refused_typed(workflow: Workflow, value: Any) -> None:
    with pytest.raises(VarsInvalid) as info:
        resolve_vars(workflow, {"ratio": value})
    assert info.value.field == "ratio"


BIG = """\
name: big
entry: a
vars:
  blob: {type: string, default: ""}
  note: {type: string, default: ""}
nodes:
  a: {kind: compute, set: {n: "len(vars.blob)"}}
"""


def test_a_launchs_vars_over_their_bound_are_refused_naming_the_largest() -> None:
    """A scale drill: a 50 MB var took a runner to 1.2 GB and made each checkpoint write slow;
    nothing bounded it but the shell's argument limit (and the API's 4 MiB body)."""
    from engine.vars import MAX_VARS_BYTES

    workflow = load_workflow(BIG, "big.yaml").workflow
    inputs = {"blob": "x" * MAX_VARS_BYTES, "note": "hi"}
    with pytest.raises(VarsInvalid) as caught:
        resolve_vars(workflow, inputs)
    assert caught.value.field == "blob" and str(MAX_VARS_BYTES) in caught.value.message
    assert caught.value.remedy is not None and "attachment" in caught.value.remedy
    # A run launched before the bound, read back at its claim, is not refused now.
    assert resolve_vars(workflow, inputs, at_launch=False)["blob"] == inputs["blob"]
    assert resolve_vars(workflow, {"blob": "x" * (MAX_VARS_BYTES // 2)})["note"] == ""
