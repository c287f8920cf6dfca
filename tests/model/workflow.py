"""The workflow every run of the model executes (call, human and fail nodes: no sandbox), and
`node`, the function behind its call nodes: the machine draws how each call ends
(`ProtocolModel.run_node`)."""

from __future__ import annotations

from typing import Any

from engine.loader import load_workflow
from engine.nodes import CallContext
from tests.model.bookkeeping import _current

GUARD = "g"
NODES = ["a", "g", "h", "c"]

CALL = "tests.model.workflow:node"
WORKFLOW = f"""\
name: model
entry: a
budget:
  max_iterations: 8
nodes:
  a:
    kind: call
    function: {CALL}
    retry: {{max: 0}}
  g:
    kind: call
    function: {CALL}
    retry: {{max: 0}}
  refuse:
    kind: fail
    code: GUARD_REFUSED
    message: the guard said no
    resumable: true
  h:
    kind: human
    questions:
      - name: go
        type: bool
  c:
    kind: call
    function: {CALL}
    retry: {{max: 0}}
edges:
  - from: a
    to: g
  - from: g
    to: h
    when: outputs.g.ok and outputs.g.ask
  - from: g
    to: c
    when: outputs.g.ok and not outputs.g.ask
  - from: g
    to: refuse
    when: not outputs.g.ok
  - from: h
    to: c
"""
V1 = load_workflow(WORKFLOW, "model.yaml")
V2 = load_workflow(WORKFLOW + "# v2: the same graph, another source hash\n", "model-v2.yaml")

NODE_RESULTS = ["ok"] * 8 + ["ask", "no", "transient", "infra", "permanent", "ambiguous", "bot"]
"""Mostly `ok`, so runs get somewhere; `ok` first, so a failing example shrinks towards it."""


async def node(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Every call node of the model's workflow: hypothesis draws how it ends. An `async def`,
    so it runs on the machine's loop: a plain `def` runs on the call threads (ADR-0022), where
    its draws raced the loop's and an example did not replay the same (hypothesis
    `FlakyStrategyDefinition`, seen since the twenty-second pass)."""
    return _current().run_node(ctx)
