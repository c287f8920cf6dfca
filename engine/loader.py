"""Load a workflow file: YAML → `Workflow`, or a `WorkflowInvalid` naming file, field and line.

PyYAML composes the node tree first; a walk over it records the line of every mapping key and
sequence item by its path (`("nodes", "build", "timeout")`), then the tree is constructed into
plain data and validated by pydantic. A `ValidationError`'s `loc` is a path too, so it maps to
the line of the deepest part that exists in the file (a discriminated union's tag, like `tool`,
is in `loc` but not in the file, and is skipped). Graph rules pydantic cannot see run after:
they need the whole workflow, and they report lines the same way.

The source hash is the sha256 of the whole text, comments included (SPEC §6.1): it answers
"is this the same file", not "is this the same graph".
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from engine.errors import ExpressionError, Problem, TemplateError, WorkflowInvalid
from engine.expressions import compile_check as check_expression
from engine.failures import is_engine_code
from engine.sandbox.registry import driver_names, options_model
from engine.templates import compile_check as check_template
from engine.templates import is_template
from engine.workflow import CallNode, ComputeNode, FailNode, HumanNode, ToolNode, Workflow

PathKey = tuple[str | int, ...]

_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it (it is, in the wheels): same documents,
same marks, several times faster than the pure-Python one."""


@dataclass(frozen=True, slots=True)
class LoadedWorkflow:
    """A validated workflow with the exact text it came from."""

    workflow: Workflow
    source: str
    source_hash: str
    filename: str = "<workflow>"


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_workflow_file(path: str | Path) -> LoadedWorkflow:
    """Read and load `path`; unreadable or non-UTF-8 files are `WorkflowInvalid` at line 1."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WorkflowInvalid(name, "", 1, f"cannot read the file: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkflowInvalid(name, "", 1, f"not UTF-8 text: {exc.reason}") from exc
    return load_workflow(text, name)


MAX_VALUES = 100_000
"""The most values a file may expand to through YAML aliases (a "billion laughs" guard)."""


def load_workflow(text: str, filename: str) -> LoadedWorkflow:
    """Validate `text` as a workflow; every problem is a `WorkflowInvalid` with a line."""
    node = _compose(text, filename)
    _check_expansion(node, filename)
    lines = _Lines(node)
    data = _construct(text, filename)
    problems = list(lines.problems)
    if not isinstance(data, dict):
        problems.append(Problem("", 1, "a workflow is a mapping with name, entry and nodes"))
        _raise(filename, problems)
    workflow: Workflow | None = None
    try:
        workflow = Workflow.model_validate(data)
    except ValidationError as exc:
        problems.extend(_problem(lines, err) for err in exc.errors(include_url=False))
    if workflow is not None:
        problems.extend(_graph_problems(workflow, lines))
        problems.extend(_sandbox_problems(workflow, lines))
    if problems or workflow is None:
        _raise(filename, problems)
    return LoadedWorkflow(workflow, text, source_hash(text), filename)


_CACHE_SIZE = 256
_cache: OrderedDict[str, LoadedWorkflow] = OrderedDict()
_cache_lock = threading.Lock()


def load_stored_workflow(text: str, filename: str) -> LoadedWorkflow:
    """`load_workflow` for a run's stored source, memoised by the source text.

    Every execution, resume and rewind re-reads the workflow from the run document; parsing it
    again each time was the largest single cost of a short run (docs/performance.md, fix 1).
    The key is the whole text (a dict's string hash and equality: cheaper than a SHA-256 of
    it per delivery, issue 19), and `Workflow` and its nodes are frozen models, so a cached
    result is the same value a fresh load would give. Only successes are kept: an invalid
    source raises every time, with `filename` in the message.
    """
    loaded = _cached(text, filename)
    return loaded if loaded.filename == filename else replace(loaded, filename=filename)


def stored_workflow(text: str, filename: str) -> Workflow:
    """`load_stored_workflow(...).workflow`, without a copy of the cached result to carry
    this caller's `filename` (the execution's hot path needs only the workflow)."""
    return _cached(text, filename).workflow


def _cached(text: str, filename: str) -> LoadedWorkflow:
    with _cache_lock:
        hit = _cache.get(text)
        if hit is not None:
            _cache.move_to_end(text)
            return hit
    loaded = load_workflow(text, filename)
    with _cache_lock:
        _cache[text] = loaded
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return loaded


def _raise(filename: str, problems: list[Problem]) -> NoReturn:
    unique = sorted(dict.fromkeys(problems), key=lambda p: p.line)
    first = unique[0]
    raise WorkflowInvalid(filename, first.field, first.line, first.message, problems=unique)


def _yaml_problem(filename: str, exc: yaml.YAMLError, text: str = "") -> WorkflowInvalid:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        message = exc.problem or "invalid YAML"
        if exc.context:
            message += f" ({exc.context})"
        lines = text.splitlines()
        # The problem mark can be the line after the value that caused it (a block mapping's
        # end): the hint looks at the marked line, then the one before, and is offered only
        # when the file, with that line quoted, gets past it.
        for at in (line, line - 1):
            hint = _quoting_hint(lines, at, line)
            if hint:
                return WorkflowInvalid(filename, "", at, f"YAML: {message}; {hint}")
        return WorkflowInvalid(filename, "", line, f"YAML: {message}")
    return WorkflowInvalid(filename, "", 1, f"YAML: {exc}")


_KEY_VALUE = re.compile(
    r"^(?P<indent>\s*)(?P<item>-\s+)?(?P<key>[A-Za-z_][\w.-]*):\s+(?P<value>\S.*?)\s*$"
)


def _quoting_hint(lines: list[str], at: int, failed_at: int) -> str | None:
    """ "quote the value: `run: 'echo a: b'`" for a plain value YAML reads as something else: one
    holding `: ` (a mapping), starting with `{{` (a flow mapping) or with a quoted part followed
    by more text. Found by a workflow author: "mapping values are not allowed here" and
    "found unhashable key" said nothing of quoting, which is the fix for both. Offered only
    when the value does not load as it is and the file with that line quoted composes, or
    fails past `failed_at` (a review: a hint on a valid line above the real error suggested a
    change that did not help)."""
    if not 0 < at <= len(lines):
        return None
    found = _KEY_VALUE.match(lines[at - 1])
    if found is None:
        return None
    value = found["value"].split(" #", 1)[0].rstrip()  # a plain value's comment stays out
    if value.startswith(("{", "[")) and not value.startswith("{{"):
        return None  # a flow collection: quoting would make it a string
    if ": " not in value and not value.startswith(("{{", "'", '"')):
        return None
    try:
        yaml.load(f"k: {value}", Loader=_SAFE_LOADER)
        return None  # it loads as it is: the problem is elsewhere
    except yaml.YAMLError:
        pass
    quoted = "'" + value.replace("'", "''") + "'"
    item = "- " if found["item"] else ""
    suggested = f"{item}{found['key']}: {quoted}"
    fixed = [*lines[: at - 1], found["indent"] + suggested, *lines[at:]]
    try:
        yaml.compose("\n".join(fixed), Loader=_SAFE_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        if mark is None or mark.line + 1 <= failed_at:
            return None
    except yaml.YAMLError:
        return None
    return f"quote the value: `{suggested}`"


def _compose(text: str, filename: str) -> yaml.Node:
    try:
        node = yaml.compose(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        raise _yaml_problem(filename, exc, text) from exc
    if node is None:
        raise WorkflowInvalid(filename, "", 1, "the file is empty")
    return node


def _check_expansion(root: yaml.Node, filename: str) -> None:
    """Refuse recursive aliases, and files whose aliases expand past `MAX_VALUES` values.

    Sizes are memoised per node, so this is linear in the file even when the expansion is not.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    aliased = False

    def size(node: yaml.Node) -> int:
        nonlocal aliased
        key = id(node)
        if key in sizes:
            aliased = True  # a node met twice: an alias
            return sizes[key]
        if key in on_path:
            line = node.start_mark.line + 1
            raise WorkflowInvalid(filename, "", line, "YAML: a recursive alias")
        on_path.add(key)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_VALUES:
                # A big file without aliases is not an alias problem (a scale drill: a
                # 5 000-node workflow was told "aliases expand" and used none).
                why = (
                    f"aliases expand to more than {MAX_VALUES} values"
                    if aliased
                    else f"the workflow is too large: more than {MAX_VALUES} values (nodes,"
                    " keys, list items); split it into smaller workflows"
                )
                raise WorkflowInvalid(filename, "", 1, f"YAML: {why}")
        on_path.discard(key)
        sizes[key] = total
        return total

    size(root)


def _construct(text: str, filename: str) -> Any:
    # A second pass constructs from a fresh tree: construction flattens merge keys (`<<`) in
    # place, and the line walk wants the tree as written.
    try:
        return yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as exc:
        raise _yaml_problem(filename, exc, text) from exc


class _Lines:
    """The 1-based line of every key and item in the file, by path; duplicate keys refused."""

    def __init__(self, root: yaml.Node) -> None:
        self.lines: dict[PathKey, int] = {(): root.start_mark.line + 1}
        self.values: dict[PathKey, yaml.Node] = {(): root}
        self.problems: list[Problem] = []
        self._walk(root, ())

    def _walk(self, node: yaml.Node, path: PathKey) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":
                    continue
                if not isinstance(key, yaml.ScalarNode):
                    self.problems.append(
                        Problem(dotted(path), key.start_mark.line + 1, "keys must be plain")
                    )
                    continue
                child = (*path, key.value)
                line = key.start_mark.line + 1
                if child in self.lines:
                    first = self.lines[child]
                    self.problems.append(
                        Problem(dotted(child), line, f"duplicate key (first at line {first})")
                    )
                    continue
                self.lines[child] = line
                self.values[child] = value
                self._walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = (*path, index)
                self.lines[child] = item.start_mark.line + 1
                self.values[child] = item
                self._walk(item, child)

    def locate(self, loc: PathKey) -> tuple[str, int]:
        """The dotted field and line for a pydantic `loc` (or any path)."""
        path: PathKey = ()
        field: list[str | int] = []
        line = self.lines[()]
        for i, elem in enumerate(loc):
            key: str | int = elem if isinstance(elem, int) else str(elem)
            candidate = (*path, key)
            if candidate in self.lines:
                path = candidate
                field.append(key)
                line = self.lines[candidate]
            elif elem == "[key]":
                continue  # a dict key failed validation: `path` already ends at that key
            elif i == len(loc) - 1:
                field.append(key)  # a missing field: name it, at its parent's line
            # else: a union tag or validator label that is not in the file
        return dotted(tuple(field)), line

    def value_line(self, path: PathKey) -> int:
        """The line a scalar's text starts on (the line after `|` / `>` for block scalars)."""
        node = self.values.get(path)
        if isinstance(node, yaml.ScalarNode) and node.style in ("|", ">"):
            return node.start_mark.line + 2
        if node is not None:
            return node.start_mark.line + 1
        return self.locate(path)[1]


def dotted(path: PathKey) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "unknown field",
}


def _problem(lines: _Lines, err: ErrorDetails) -> Problem:
    loc: PathKey = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        loc = (*loc, "kind")
        expected = ctx.get("expected_tags", "'tool', 'compute', 'human', 'call', 'fail'")
        if kind == "union_tag_invalid":
            message = f"unknown node kind {ctx.get('tag')!r} (expected one of {expected})"
        else:
            message = f"is required (one of {expected})"
    elif kind in _MESSAGES:
        message = _MESSAGES[kind]
    elif kind == "greater_than":
        message = f"must be > {ctx['gt']}"
    elif kind == "greater_than_equal":
        message = f"must be >= {ctx['ge']}"
    elif kind == "less_than_equal":
        message = f"must be <= {ctx['le']}"
    elif kind == "literal_error":
        message = f"must be {ctx['expected']}"
    elif kind == "value_error":
        message = str(ctx.get("error", err["msg"]))
    else:
        message = err["msg"][:1].lower() + err["msg"][1:]
    field, line = lines.locate(loc)
    return Problem(field, line, message)


def _graph_problems(wf: Workflow, lines: _Lines) -> Iterator[Problem]:
    def at(path: PathKey, message: str) -> Problem:
        field, line = lines.locate(path)
        return Problem(field, line, message)

    if wf.entry not in wf.nodes:
        yield at(("entry",), f"no node {wf.entry!r} (nodes: {', '.join(wf.nodes)})")

    loops: dict[str, tuple[int, int]] = {}
    for i, edge in enumerate(wf.edges):
        for end, node_id in (("from", edge.from_), ("to", edge.to)):
            if node_id not in wf.nodes:
                yield at(("edges", i, end), f"no node {node_id!r}")
        source = wf.nodes.get(edge.from_)
        if isinstance(source, FailNode):
            yield at(("edges", i, "from"), f"{edge.from_!r} is a fail node: it ends the run")
        if edge.when is not None:
            yield from _expression(lines, ("edges", i, "when"), edge.when)
        if edge.loop is not None:
            seen = loops.setdefault(edge.loop.name, (edge.loop.max, i))
            if seen[0] != edge.loop.max:
                yield at(
                    ("edges", i, "loop", "max"),
                    f"loop {edge.loop.name!r} has max {seen[0]} at edges[{seen[1]}]",
                )

    for node_id, node in wf.nodes.items():
        base: PathKey = ("nodes", node_id)
        if isinstance(node, ToolNode):
            yield from _template(lines, (*base, "run"), node.run, shell=True)
        elif isinstance(node, ComputeNode):
            for name, expr in node.set.items():
                yield from _expression(lines, (*base, "set", name), expr)
        elif isinstance(node, CallNode):
            for path, text in _strings(node.inputs, (*base, "inputs")):
                yield from _template(lines, path, text, shell=False)
        elif isinstance(node, HumanNode):
            yield from _template(lines, (*base, "message"), node.message, shell=False)
            names: set[str] = set()
            for q_index, question in enumerate(node.questions):
                if question.name in names:
                    yield at((*base, "questions", q_index, "name"), "duplicate question name")
                names.add(question.name)
        elif isinstance(node, FailNode):
            if is_engine_code(node.code):
                yield at(
                    (*base, "code"),
                    f"{node.code} is an engine failure code; a fail node needs a code of its own",
                )
            yield from _template(lines, (*base, "message"), node.message, shell=False)


def _sandbox_problems(wf: Workflow, lines: _Lines) -> Iterator[Problem]:
    """`sandbox: {driver, options}` (SPEC §7.1, v2.2): a driver the registry knows, and only
    the options that driver takes (each driver's options model, `registry.options_model`)."""
    driver, options = wf.sandbox.driver, wf.sandbox.options
    if driver is None:
        if options:
            field, line = lines.locate(("sandbox", "options"))
            yield Problem(field, line, "options need a driver: name sandbox.driver")
        return
    if driver not in driver_names():
        field, line = lines.locate(("sandbox", "driver"))
        known = ", ".join(driver_names())
        yield Problem(field, line, f"no sandbox driver {driver!r} (known: {known})")
        return
    try:
        options_model(driver).model_validate(options)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            loc = ("sandbox", "options", *err["loc"])
            yield _problem(lines, {**err, "loc": loc})


_TOO_DEEP = "too deeply nested to check"
"""A text nested past the parser's depth (RecursionError/MemoryError from a parser): the
checkers turn it into their own error; this is the backstop so it is never untyped."""


def _expression(lines: _Lines, path: PathKey, expr: str) -> Iterator[Problem]:
    try:
        check_expression(expr)
    except ExpressionError as exc:
        field, line = lines.locate(path)
        yield Problem(field, line, exc.detail)
    except (RecursionError, MemoryError):
        field, line = lines.locate(path)
        yield Problem(field, line, _TOO_DEEP)


def _template(lines: _Lines, path: PathKey, text: str, *, shell: bool) -> Iterator[Problem]:
    if not is_template(text):
        return
    try:
        check_template(text, shell=shell)
    except TemplateError as exc:
        field, _ = lines.locate(path)
        line = lines.value_line(path) + (exc.lineno - 1 if exc.lineno else 0)
        yield Problem(field, line, f"template: {exc.detail}")
    except (RecursionError, MemoryError):
        field, _ = lines.locate(path)
        yield Problem(field, lines.value_line(path), f"template: {_TOO_DEEP}")


def _strings(value: Any, path: PathKey) -> Iterator[tuple[PathKey, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, (*path, index))
