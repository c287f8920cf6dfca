"""Which nodes' outputs a workflow's expressions and templates name (`outputs.X`,
`outputs['X']`): read from their syntax trees, never by pattern over the text, so a shell
command that merely prints the word `outputs.x` outside `{{ }}` names nothing.

`runfleet validate` warns of a name no node has: such a reference can only fail
`EXPRESSION_FAILED` when it runs (found by a workflow author's walkthrough, who met it at the
fourth node of a run). A warning, not a load error: `outputs.get('x')` and `'x' in outputs`
are how a workflow asks after an output that may not be there, and they stay quiet.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import jinja2
from jinja2 import nodes as jnodes

from engine.templates import is_template
from engine.workflow import CallNode, ComputeNode, FailNode, HumanNode, ToolNode, Workflow

_PARSER = jinja2.Environment()
"""Parsing only (no rendering): the engine's sandboxed environments share Jinja's syntax."""


def output_references(workflow: Workflow) -> Iterator[tuple[str, str]]:
    """(where, node name) for every `outputs.<name>` an expression or a template names."""
    return references(workflow, "outputs")


def references(workflow: Workflow, root: str) -> Iterator[tuple[str, str]]:
    """(where, name) for every `<root>.<name>` (`<root>['name']`) an expression or a template
    names: `outputs` (node names) or `vars` (declared vars)."""
    for i, edge in enumerate(workflow.edges):
        if edge.when is not None:
            for name in _in_expression(edge.when, root):
                yield f"edges[{i}].when", name
    for node_id, node in workflow.nodes.items():
        where = f"node {node_id!r}"
        if isinstance(node, ToolNode):
            texts: list[str] = [node.run]
        elif isinstance(node, ComputeNode):
            for expr in node.set.values():
                for name in _in_expression(expr, root):
                    yield where, name
            continue
        elif isinstance(node, CallNode):
            # Only an input that is a string is rendered; nested values pass as written.
            texts = [v for v in node.inputs.values() if isinstance(v, str)]
        elif isinstance(node, HumanNode | FailNode):
            texts = [node.message]
            where = f"the message of node {node_id!r}"
        else:
            continue
        for text in texts:
            for name in _in_template(text, root):
                yield where, name


def _in_expression(expr: str, root: str) -> Iterator[str]:
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        return  # the loader has said so already
    called = {id(sub.func) for sub in ast.walk(tree) if isinstance(sub, ast.Call)}
    for sub in ast.walk(tree):
        if id(sub) in called:  # `outputs.get(...)`: a method, not a node
            continue
        if isinstance(sub, ast.Attribute) and _is_name(sub.value, root):
            yield sub.attr
        elif (
            isinstance(sub, ast.Subscript)
            and _is_name(sub.value, root)
            and isinstance(sub.slice, ast.Constant)
            and isinstance(sub.slice.value, str)
        ):
            yield sub.slice.value


def _is_name(node: ast.AST, root: str) -> bool:
    return isinstance(node, ast.Name) and node.id == root


def _in_template(text: str, root: str) -> Iterator[str]:
    if not is_template(text):
        return
    try:
        tree = _PARSER.parse(text)
    except (jinja2.TemplateSyntaxError, RecursionError, MemoryError):
        return
    called = {id(call.node) for call in tree.find_all(jnodes.Call)}
    for sub in tree.find_all((jnodes.Getattr, jnodes.Getitem)):
        if id(sub) in called or not _is_jinja_name(getattr(sub, "node", None), root):
            continue
        if isinstance(sub, jnodes.Getattr):
            yield sub.attr
        elif isinstance(sub, jnodes.Getitem):
            arg = sub.arg
            if isinstance(arg, jnodes.Const) and isinstance(arg.value, str):
                yield arg.value


def _is_jinja_name(node: object, root: str) -> bool:
    return isinstance(node, jnodes.Name) and node.name == root
