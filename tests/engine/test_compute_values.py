"""A `compute` node's values are stored in the checkpoint (SPEC §6.1 `compute`: failure →
`EXPRESSION_FAILED`). Found by a newcomer's walkthrough: the docs list sets among the literals,
and `{1, 2}`, `b'x'`, `1j`, a tuple-keyed dict or NaN crashed `runfleet run` with `internal`
(the run left `running`), and on a fleet jammed the run behind naks blamed on the store. Such a
value fails the node, naming the field and what to give instead; what JSON holds is stored."""

from __future__ import annotations

import pytest

from engine.failures import FailureCode
from engine.loader import load_workflow
from engine.local import LocalEnv, run_local
from store import RunStatus


def one_compute(expr: str) -> str:
    return f"""\
name: values
entry: a
nodes:
  a:
    kind: compute
    set:
      v: {expr!r}
"""


@pytest.mark.parametrize("expr", ["{1, 2}", "b'x'", "1j", "{(1, 2): 3}", "float('nan')"])
async def test_a_compute_value_json_cannot_hold_fails_the_node_naming_it(
    env: LocalEnv, expr: str
) -> None:
    doc = await run_local(env, load_workflow(one_compute(expr), "values.yaml"), {})
    assert doc.status is RunStatus.FAILED, doc
    assert doc.failure_code == FailureCode.EXPRESSION_FAILED
    assert (
        doc.error is not None and "set.v" in doc.error and "cannot be stored as JSON" in doc.error
    )
    assert doc.lease is None  # settled and released, not left `running`


async def test_a_compute_value_json_holds_is_stored_a_tuple_as_a_list(env: LocalEnv) -> None:
    doc = await run_local(env, load_workflow(one_compute("(1, 'a', [2.5, None])"), "v.yaml"), {})
    assert doc.status is RunStatus.FINISHED, doc
    assert doc.checkpoint is not None and doc.checkpoint.outputs["a"] == {
        "v": [1, "a", [2.5, None]]
    }
