"""Loading workflow files (SPEC §6.1): validated models, or errors with file, field and line."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.errors import WorkflowInvalid
from engine.expressions import evaluate, evaluate_condition
from engine.loader import load_workflow, load_workflow_file
from engine.workflow import ComputeNode, FailNode, HumanNode, ToolNode, Workflow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def wf(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


VALID = wf(
    """
    name: demo
    entry: build
    nodes:
      build:
        kind: tool
        run: make {{ vars.target }}
        timeout: 5m
        retry: {max: 3, backoff: 2s}
      decide:
        kind: compute
        set:
          ok: outputs.build.exit_code == 0
      ask:
        kind: human
        questions:
          - {name: approved, type: bool}
      notify:
        kind: call
        function: integrations.chat:post
        inputs: {text: "built {{ vars.target }}", retries: 2}
      stop:
        kind: fail
        code: NOT_APPROVED
        message: "rejected: {{ outputs.ask.approved }}"
    vars:
      target: {type: string, default: all}
    budget: {max_duration: 1h, max_iterations: 100, max_cost_usd: 2.5}
    sandbox: {driver: local}
    edges:
      - {from: build, to: decide}
      - {from: decide, to: ask, when: outputs.decide.ok}
      - {from: ask, to: notify, when: outputs.ask.approved}
      - {from: ask, to: stop, when: not outputs.ask.approved}
    """
)


@pytest.mark.parametrize("name", ["hello.yaml", "approval.yaml", "budget_guard.yaml"])
def test_examples_load(name: str) -> None:
    loaded = load_workflow_file(EXAMPLES / name)
    assert loaded.workflow.entry in loaded.workflow.nodes
    assert loaded.source == (EXAMPLES / name).read_text(encoding="utf-8")
    assert loaded.filename == str(EXAMPLES / name)


def test_a_valid_workflow_loads_into_typed_models() -> None:
    loaded = load_workflow(VALID, "demo.yaml")
    w = loaded.workflow
    build = w.nodes["build"]
    assert isinstance(build, ToolNode)
    assert build.timeout == 300.0
    assert build.retry is not None and (build.retry.max, build.retry.backoff) == (3, 2.0)
    assert isinstance(w.nodes["decide"], ComputeNode)
    assert isinstance(w.nodes["ask"], HumanNode)
    assert isinstance(w.nodes["stop"], FailNode) and not w.nodes["stop"].resumable
    assert w.budget.max_duration == 3600.0
    assert w.budget.to_store().max_cost_usd == 2.5
    assert w.sandbox.driver == "local"
    assert w.vars["target"].default == "all"
    assert [e.to for e in w.outgoing("ask")] == ["notify", "stop"]
    assert w.predecessors("ask") == ["decide"]
    assert w.successors("ask") == {"notify", "stop"}
    assert w.guard_of("stop") == "ask"
    assert w.guard_of("build") is None


def test_defaults() -> None:
    w = load_workflow(
        "name: d\nentry: a\nnodes:\n  a: {kind: tool, run: 'true'}\n", "d.yaml"
    ).workflow
    node = w.nodes["a"]
    assert isinstance(node, ToolNode)
    assert (node.timeout, node.output, node.retry) == (600.0, "text", None)
    assert w.sandbox.driver is None and w.sandbox.options == {}
    assert w.edges == [] and w.vars == {}


HEAD = "name: x\nentry: a\nnodes:\n  a:\n    kind: tool\n    run: echo hi\n"  # lines 1-6

BROKEN: list[tuple[str, str, int, str, str]] = [
    # (case, yaml, line, field, message fragment)
    ("timeout zero", HEAD + "    timeout: 0\n", 7, "nodes.a.timeout", "must be > 0"),
    ("bad duration", HEAD + "    timeout: 5x\n", 7, "nodes.a.timeout", "duration"),
    ("unknown field", HEAD + "    colour: red\n", 7, "nodes.a.colour", "unknown field"),
    ("bad output", HEAD + "    output: xml\n", 7, "nodes.a.output", "'text' or 'json'"),
    (
        "unknown kind",
        HEAD + "  b:\n    kind: tol\n    run: x\n",
        8,
        "nodes.b.kind",
        "unknown node kind 'tol'",
    ),
    ("missing kind", HEAD + "  b:\n    run: x\n", 7, "nodes.b.kind", "is required"),
    ("missing run", HEAD + "  b:\n    kind: tool\n", 7, "nodes.b.run", "is required"),
    ("bad node id", HEAD + "  my-node:\n    kind: tool\n    run: x\n", 7, "nodes.my-node", "id"),
    (
        "duplicate node",
        HEAD + "  a:\n    kind: tool\n    run: y\n",
        7,
        "nodes.a",
        "duplicate key (first at line 4)",
    ),
    (
        "edge without to",
        HEAD + "edges:\n  - from: a\n    when: 'true'\n",
        8,
        "edges[0].to",
        "is required",
    ),
    (
        "unknown edge target",
        HEAD + "edges:\n  - from: a\n    to: nowhere\n",
        9,
        "edges[0].to",
        "no node 'nowhere'",
    ),
    (
        "unknown edge source",
        HEAD + "edges:\n  - {from: zz, to: a}\n",
        8,
        "edges[0].from",
        "no node 'zz'",
    ),
    ("unknown entry", HEAD.replace("entry: a", "entry: b"), 2, "entry", "no node 'b'"),
    (
        "when does not parse",
        HEAD + "  b: {kind: tool, run: x}\nedges:\n  - from: a\n    to: b\n    when: vars.n >\n",
        11,
        "edges[0].when",
        "syntax error",
    ),
    (
        "when names an unknown root",
        HEAD + "  b: {kind: tool, run: x}\nedges:\n  - {from: a, to: b, when: output.a.ok}\n",
        9,
        "edges[0].when",
        "unknown name 'output'",
    ),
    (
        "set expression",
        HEAD + "  c:\n    kind: compute\n    set:\n      y: 1 +\n",
        10,
        "nodes.c.set.y",
        "syntax error",
    ),
    (
        "template in a block scalar",
        HEAD + "  t:\n    kind: tool\n    run: |\n      echo one\n      echo {{ vars.x\n",
        11,
        "nodes.t.run",
        "template",
    ),
    (
        "fail code collides with an engine code",
        HEAD + "  f:\n    kind: fail\n    code: TIMEOUT\n",
        9,
        "nodes.f.code",
        "engine failure code",
    ),
    (
        "fail code is not a code",
        HEAD + "  f:\n    kind: fail\n    code: my code\n",
        9,
        "nodes.f.code",
        "upper-case code",
    ),
    (
        "a fail node has no way out",
        HEAD
        + "  f: {kind: fail, code: STOP}\nedges:\n  - {from: a, to: f}\n  - {from: f, to: a}\n",
        10,
        "edges[1].from",
        "fail node",
    ),
    (
        "one loop, two maxima",
        HEAD
        + "edges:\n"
        + "  - {from: a, to: a, loop: {name: l, max: 2}}\n"
        + "  - from: a\n    to: a\n    loop:\n      name: l\n      max: 3\n",
        13,
        "edges[1].loop.max",
        "loop 'l' has max 2",
    ),
    (
        "var default of the wrong type",
        HEAD + "vars:\n  n:\n    type: int\n    default: two\n",
        8,
        "vars.n",
        "not of type int",
    ),
    (
        "duplicate question",
        HEAD
        + "  h:\n    kind: human\n    questions:\n      - {name: q, type: bool}\n"
        + "      - {name: q, type: int}\n",
        11,
        "nodes.h.questions[1].name",
        "duplicate question",
    ),
    (
        "bad call reference",
        HEAD + "  c:\n    kind: call\n    function: not a function\n",
        9,
        "nodes.c.function",
        "pkg.module:func",
    ),
    ("yaml syntax", HEAD + "  b: [unclosed\n  c: 1\n", 8, "", "YAML"),
    ("yaml indentation", HEAD + "   bad: indent\n", 7, "", "YAML"),
    ("empty file", "", 1, "", "empty"),
    ("recursive alias", "a: &a [*a]\n", 1, "", "recursive alias"),
    ("not a mapping", "- 1\n- 2\n", 1, "", "mapping"),
]


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [pytest.param(*case[1:], id=case[0]) for case in BROKEN],
)
def test_invalid_workflow_is_refused_at_load_with_file_field_and_line(
    text: str, line: int, field: str, fragment: str
) -> None:
    with pytest.raises(WorkflowInvalid) as info:
        load_workflow(text, "examples/x.yaml")
    err = info.value
    assert (err.file, err.field, err.line) == ("examples/x.yaml", field, line), err.problems
    assert fragment in err.detail
    where = f"{field}: " if field else ""
    assert str(err) == f"examples/x.yaml:{line}: {where}{err.detail}"
    assert err.code == "workflow_invalid"


def test_error_message_reads_file_line_field_message() -> None:
    with pytest.raises(WorkflowInvalid) as info:
        load_workflow(HEAD + "    timeout: 0\n", "examples/x.yaml")
    assert str(info.value) == "examples/x.yaml:7: nodes.a.timeout: must be > 0"


def test_every_problem_is_listed_in_line_order() -> None:
    text = HEAD + "    timeout: -1\n    output: xml\n  b:\n    kind: nope\n"
    with pytest.raises(WorkflowInvalid) as info:
        load_workflow(text, "x.yaml")
    assert [(p.field, p.line) for p in info.value.problems] == [
        ("nodes.a.timeout", 7),
        ("nodes.a.output", 8),
        ("nodes.b.kind", 10),
    ]


def test_bot_code_colliding_with_an_engine_code_is_refused() -> None:
    for code in ("BUDGET_EXCEEDED", "DLQ_PARKED", "RATE_LIMITED"):
        text = HEAD + f"  f:\n    kind: fail\n    code: {code}\n    resumable: true\n"
        with pytest.raises(WorkflowInvalid, match="engine failure code"):
            load_workflow(text, "x.yaml")
    load_workflow(HEAD + "  f:\n    kind: fail\n    code: BUDGET_GUARD\n", "x.yaml")


def test_alias_bombs_are_refused_quickly() -> None:
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(WorkflowInvalid, match="aliases expand"):
        load_workflow("\n".join(levels) + "\n", "bomb.yaml")


def test_source_hash_covers_the_whole_text() -> None:
    a = load_workflow(VALID, "x.yaml")
    b = load_workflow(VALID + "# a comment changes nothing in the graph\n", "x.yaml")
    assert a.workflow == b.workflow
    assert a.source_hash != b.source_hash
    assert a.source_hash == hashlib.sha256(VALID.encode("utf-8")).hexdigest()
    assert b.source == VALID + "# a comment changes nothing in the graph\n"


def test_unreadable_file_is_workflow_invalid(tmp_path: Path) -> None:
    with pytest.raises(WorkflowInvalid, match="cannot read"):
        load_workflow_file(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(WorkflowInvalid, match="UTF-8"):
        load_workflow_file(bad)


# -- the examples behave as their comments say ---------------------------------------------------


def walk(w: Workflow, scope: dict[str, Any], start: str, max_nodes: int = 50) -> str:
    """A toy interpreter for compute-only paths: returns the node it stopped at.

    Stops at a node that is not `compute` (human, fail, tool) or has no outgoing edge.
    """
    node_id = start
    for _ in range(max_nodes):
        node = w.nodes[node_id]
        if not isinstance(node, ComputeNode):
            return node_id
        scope["outputs"][node_id] = {k: evaluate(e, scope) for k, e in node.set.items()}
        edges = [
            e for e in w.outgoing(node_id) if e.when is None or evaluate_condition(e.when, scope)
        ]
        if not edges:
            return node_id
        node_id = edges[0].to
    raise AssertionError("did not stop")


def test_budget_guard_parks_then_takes_the_other_edge_after_a_raised_cap() -> None:
    w = load_workflow_file(EXAMPLES / "budget_guard.yaml").workflow
    scope: dict[str, Any] = {
        "vars": {name: spec.default for name, spec in w.vars.items()},
        "outputs": {},
        "budget": {"max_iterations": None},
    }
    stopped = walk(w, scope, w.entry)
    assert stopped == "over_budget"
    fail = w.nodes["over_budget"]
    assert isinstance(fail, FailNode) and fail.resumable and fail.code == "BUDGET_GUARD"
    assert scope["outputs"]["step"]["n"] == 2
    guard = w.guard_of("over_budget")
    assert guard == "check"
    # the resume raised the cap, and re-executes the guard
    scope["budget"] = {"max_iterations": 20}
    assert walk(w, scope, guard) == "done"
    assert scope["outputs"]["done"] == {"total": 4}


@pytest.mark.parametrize(("approved", "branch"), [(True, "accepted"), (False, "rejected")])
def test_approval_both_paths_finish(approved: bool, branch: str) -> None:
    w = load_workflow_file(EXAMPLES / "approval.yaml").workflow
    scope: dict[str, Any] = {
        "vars": {name: spec.default for name, spec in w.vars.items()},
        "outputs": {},
    }
    assert walk(w, scope, w.entry) == "review"
    scope["outputs"]["review"] = {"approved": approved, "note": None}
    assert walk(w, scope, "accepted" if approved else "rejected") == branch
    taken = [
        e.to for e in w.outgoing("review") if e.when is None or evaluate_condition(e.when, scope)
    ]
    assert taken == [branch]
    assert w.outgoing(branch) == []


def test_hello_summary_reads_the_tool_output() -> None:
    w = load_workflow_file(EXAMPLES / "hello.yaml").workflow
    scope: dict[str, Any] = {"vars": {"name": "world"}, "outputs": {"greet": "hello world"}}
    assert walk(w, scope, "summarize") == "summarize"
    assert scope["outputs"]["summarize"] == {"greeting": "hello world", "as_expected": True}


def test_stored_workflow_is_parsed_once_per_source_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Executions re-read the run's stored source; the parse is memoised by its hash."""
    from engine import loader

    text = VALID + "# cache probe 1\n"
    calls: list[str] = []
    real = loader.load_workflow

    def counting(source: str, filename: str) -> Any:
        calls.append(filename)
        return real(source, filename)

    monkeypatch.setattr(loader, "load_workflow", counting)
    first = loader.load_stored_workflow(text, "run a")
    second = loader.load_stored_workflow(text, "run b")
    assert calls == ["run a"]
    assert second.workflow is first.workflow
    assert (first.filename, second.filename) == ("run a", "run b")
    changed = loader.load_stored_workflow(text + "# one more comment\n", "run c")
    assert calls == ["run a", "run c"]
    assert changed.source_hash != first.source_hash


def test_stored_workflow_that_is_invalid_is_refused_every_time() -> None:
    from engine.loader import load_stored_workflow

    broken = HEAD + "    timeout: 0\n"
    for name in ("run a", "run b"):
        with pytest.raises(WorkflowInvalid) as info:
            load_stored_workflow(broken, name)
        assert info.value.file == name


def test_stored_workflow_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import loader

    monkeypatch.setattr(loader, "_CACHE_SIZE", 3)
    monkeypatch.setattr(loader, "_cache", type(loader._cache)())
    texts = [VALID + f"# bound {i}\n" for i in range(5)]
    for text in texts:
        loader.load_stored_workflow(text, "run")
    assert list(loader._cache) == texts[2:]


def test_an_expression_or_template_too_deep_to_parse_is_workflow_invalid_naming_the_field() -> None:
    text = textwrap.dedent(
        """\
        name: deep
        entry: a
        nodes:
          a: {kind: compute, set: {x: "%s"}}
          b: {kind: tool, run: "echo {{ %s }}"}
        edges:
          - {from: a, to: b, when: "%s"}
        """
    ) % ("-" * 100_000 + "1", "1" + "+1" * 100_000, "1" + "+1" * 100_000)
    with pytest.raises(WorkflowInvalid) as info:
        load_workflow(text, "examples/deep.yaml")
    found = {(p.field, p.line) for p in info.value.problems}
    assert found == {("nodes.a.set.x", 4), ("nodes.b.run", 5), ("edges[0].when", 7)}
    assert all("too deeply nested" in p.message for p in info.value.problems)


@pytest.mark.parametrize(
    ("value", "suggested"),
    [
        ("echo hello: world", "`run: 'echo hello: world'`"),
        ("{{ vars.who }}", "`run: '{{ vars.who }}'`"),
        ('"{{ vars.who }}" is here', "`run: '\"{{ vars.who }}\" is here'`"),
        ("it's: here", "`run: 'it''s: here'`"),
    ],
    ids=["colon-space", "template-first", "quoted-then-more", "apostrophe"],
)
def test_a_yaml_error_a_plain_value_caused_suggests_quoting_it(value: str, suggested: str) -> None:
    text = (
        "name: q\nentry: greet\nvars:\n  who: {type: string, default: x}\n"
        f"nodes:\n  greet:\n    kind: tool\n    run: {value}\n"
    )
    with pytest.raises(WorkflowInvalid) as caught:
        load_workflow(text, "q.yaml")
    problem = caught.value.problems[0]
    assert problem.line == 8
    assert problem.message.startswith("YAML: ")
    assert f"quote the value: {suggested}" in problem.message
    # ... and the suggestion, put in its place, loads.
    fixed = text.replace(f"run: {value}", suggested.strip("`"))
    assert load_workflow(fixed, "q.yaml").workflow.nodes["greet"]


QUOTED_HEAD = "name: q\nentry: g\nnodes:\n  g:\n"


@pytest.mark.parametrize(
    "text",
    [
        "name: q\nnodes: [\n",
        # A valid quoted value above a badly indented line (a review: it was offered a hint
        # that turned the expression into a string and left the error where it was).
        QUOTED_HEAD
        + "    kind: compute\n    set:\n      label: 'outputs.x == ''big'''\n     bad: x\n",
        QUOTED_HEAD + '    kind: tool\n    run: "a \\"b\\": c"\n   bad: x\n',
        # An unclosed flow mapping: quoting it would make the mapping a string.
        QUOTED_HEAD + "    kind: tool\n    run: echo\n    env: {A: 1, B: 2\n",
    ],
    ids=["unclosed-list", "quoted-value-above-bad-indent", "escaped-quotes", "unclosed-flow"],
)
def test_a_yaml_error_a_plain_value_did_not_cause_suggests_no_quoting(text: str) -> None:
    with pytest.raises(WorkflowInvalid) as caught:
        load_workflow(text, "q.yaml")
    assert "quote the value" not in caught.value.problems[0].message


def test_the_quoting_hint_keeps_a_list_items_dash_and_leaves_a_comment_out() -> None:
    text = QUOTED_HEAD + "    kind: tool\n    run: echo\nedges:\n  - from: g\n    to: h\n"
    text += "  - when: a: b  # why\n"
    with pytest.raises(WorkflowInvalid) as caught:
        load_workflow(text, "q.yaml")
    assert "quote the value: `- when: 'a: b'`" in caught.value.problems[0].message
