"""Safe expressions for `when` and `set` (SPEC §6.1), over simpleeval (ADR-0005).

An expression reads a context of plain data: `vars`, `outputs`, `answers`, `loop`, `budget`
(the run's effective caps) and `usage` (its accounting). Attribute access on a mapping is a key
lookup, so `outputs.build.ok` reads `context["outputs"]["build"]["ok"]`; a missing key is an
error naming the path, not a silent `None` (a misspelt field in a `when` would otherwise route
the run).

What keeps it safe, in layers:
- never `eval`/`exec`: simpleeval walks the AST and has a handler per allowed node type;
- only the functions in `FUNCTIONS` can be called, plus a few read-only `str` methods;
- no attribute starting with `_` (so no `__class__`, `__globals__`), and attributes on anything
  but a mapping or a string are refused: there are no objects in the context to reach into;
- bounded work: `**` refuses a result over `MAX_POWER_BITS` bits (simpleeval's own bound is on
  the operands, and `4000000 ** 4000000` passes it), simpleeval bounds repetition (`"a" * n`)
  and concatenation to `simpleeval.MAX_STRING_LENGTH` items and a comprehension to
  `simpleeval.MAX_COMPREHENSION_LENGTH` iterations, and one evaluation may build at most
  `MAX_BUILT_ITEMS` characters/items in all (a comprehension of big strings passes each
  per-operation bound, but not this one). String formatting is measured before it is done
  (simpleeval measures after): `%` and an f-string field are bounded like `+`, `str()` by
  `MAX_BUILT_ITEMS`, and the value's text by `MAX_RESULT_CHARS`, each counting an item a list
  holds many times each time (`text_size`). Evaluation is synchronous, on the runner's loop.

`compile_check` runs the same rules statically at load, so a typo in a `when` is a load error
with a line instead of an `EXPRESSION_FAILED` an hour into a run.
"""

from __future__ import annotations

import ast
import math
import re
import threading
import types
from collections.abc import Callable, Collection, Mapping
from functools import lru_cache
from typing import Any

from simpleeval import (
    MAX_STRING_LENGTH,
    EvalWithCompoundTypes,
    FeatureNotAvailable,
    InvalidExpression,
    IterableTooLong,
    NumberTooHigh,
    safe_power,
)

from engine.errors import ExpressionError

CONTEXT_ROOTS: frozenset[str] = frozenset({"vars", "outputs", "answers", "loop", "budget", "usage"})
"""The names an expression may start from; the executor provides each (empty when unset).

`budget` is the run's effective caps (`max_duration`, `max_iterations`, `max_cost_usd`, `None`
when uncapped) and `usage` its accounting (`elapsed`, `iterations`, `cost_usd`).
"""


def text_size(value: Any, limit: int, *, unwrap: Callable[[Any], Any] | None = None) -> int:
    """About how long `value` is as text (`str`, `repr` or JSON), found without building it;
    past `limit` the walk stops and the answer is `limit + 1`.

    A container may hold one item many times (`[s] * 100000` is a small list whose text is
    100 000 copies of `s`; doubling `[v, v]` in a loop reaches 2**60), so a container counts
    each item every time it holds it, but walks each object once. A string counts its length
    (escaping adds a small constant factor at most); a container that holds itself counts the
    inner occurrence as small, as `repr` does. `unwrap` may turn an object into the container
    its text shows (a Jinja namespace shows its attributes).
    """
    if isinstance(value, str | int | float | bool) or value is None:  # the common case, cheaply
        return min(_leaf_size(value), limit + 1)
    sizes: dict[int, int] = {}
    walking: set[int] = set()
    stack: list[Any] = [value]
    while stack:
        obj = stack[-1]
        key = id(obj)
        if key in sizes:
            stack.pop()
            continue
        shown = unwrap(obj) if unwrap is not None else obj
        items = _items(shown)
        if items is None:
            sizes[key] = _leaf_size(shown)
            stack.pop()
            continue
        if key not in walking:
            walking.add(key)
            stack.extend(i for i in items if id(i) not in sizes and id(i) not in walking)
            continue
        size = 2
        for item in items:
            size += sizes.get(id(item), 8) + 2
            if size > limit:
                return limit + 1
        sizes[key] = size
        walking.discard(key)
        stack.pop()
    return min(sizes[id(value)], limit + 1)


def _items(obj: Any) -> list[Any] | None:
    if isinstance(obj, str | bytes | bytearray):
        return None
    if isinstance(obj, Mapping):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, Collection):
        return list(obj)
    return None


def _leaf_size(obj: Any) -> int:
    if isinstance(obj, str | bytes | bytearray):
        return len(obj) + 2
    if isinstance(obj, bool) or obj is None:
        return 5
    if isinstance(obj, int):
        return obj.bit_length() // 3 + 2  # decimal digits are under a third of the bits
    return 32  # a float, or an object whose text is its short repr


_PRINTF_SPEC = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d*))?"
    r"[hlL]?(?P<kind>.?)",
    re.DOTALL,
)
_SPEC_NUMBER = re.compile(r"\d+")


def _number(digits: str) -> int:
    # Past nine digits a width is refused anyway; `int()` of thousands of digits raises.
    return int(digits) if len(digits) <= 9 else 10**10


def printf_size(fmt: str, args: Any, limit: int) -> int:
    """About how long `fmt % args` is, found before building it: a width or precision makes
    text out of nothing (`'%*s' % (10**9, '')`), and a `%s` of a shared item repeats it. Past
    `limit`, `limit + 1`; for a malformed format, an estimate (the `%` itself then raises)."""
    positional = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, Mapping) else None
    cursor = 0

    def take() -> Any:
        nonlocal cursor
        cursor += 1
        return positional[cursor - 1] if cursor <= len(positional) else None

    def amount(spec: str | None) -> int:
        if spec == "*":
            given = take()
            return given if isinstance(given, int) and given > 0 else 0
        return _number(spec) if spec else 0

    total = len(fmt)
    for match in _PRINTF_SPEC.finditer(fmt):
        if match["kind"] == "%":
            continue
        total += amount(match["width"]) + amount(match["precision"])
        key = match["key"]
        value = mapping.get(key) if key is not None and mapping is not None else take()
        total += text_size(value, limit) + (320 if isinstance(value, float) else 0)  # `%f` of 1e308
        if total > limit:
            return limit + 1
    return total


def format_spec_size(spec: str) -> int:
    """The most text a `format()` spec asks for by itself: its width and precision (every
    number in it is counted, which is never less)."""
    return sum(_number(n) for n in _SPEC_NUMBER.findall(spec))


def _bounded_str(*args: Any) -> str:
    """`str()`, refusing a value whose text is over `MAX_BUILT_ITEMS` before building it."""
    if args and text_size(args[0], MAX_BUILT_ITEMS) > MAX_BUILT_ITEMS:
        raise IterableTooLong(f"str() would make over {MAX_BUILT_ITEMS} characters")
    return str(*args)


def _modulo(left: Any, right: Any) -> Any:
    """`%`; as string formatting, its result is bounded like `+`'s (simpleeval's own is not)."""
    if isinstance(left, str) and printf_size(left, right, MAX_STRING_LENGTH) > MAX_STRING_LENGTH:
        raise IterableTooLong(f"the formatted string would be over {MAX_STRING_LENGTH} characters")
    return left % right


FUNCTIONS: Mapping[str, Callable[..., Any]] = types.MappingProxyType(
    {
        "len": len,
        "int": int,
        "float": float,
        "str": _bounded_str,
        "bool": bool,
        "min": min,
        "max": max,
        "abs": abs,
        "round": round,
    }
)

MAX_POWER_BITS = 4096
"""The largest `**` result, in bits, of an int power (about 1 200 decimal digits)."""

MAX_BUILT_ITEMS = 10_000_000
"""The characters/items one evaluation may build in all (strings, lists, ... it makes)."""

MAX_RESULT_CHARS = 100_000_000
"""The longest text (JSON) an expression's value may have.

The value is stored as JSON, but a list can hold one item many times: `[s] * 100000` with a
100 000-character `s` passes every per-operation bound and is 10**10 characters as JSON. Above
what one evaluation may build plus any stored output it passes through (each at most the
output cap), far below what repeating shared items reaches."""

_STR_METHODS: frozenset[str] = frozenset(
    {"lower", "upper", "strip", "lstrip", "rstrip", "startswith", "endswith", "split"}
)
"""Read-only string methods whose output is bounded by their input (no `format`, no `join`)."""

_ALLOWED_NODES: tuple[type[ast.AST], ...] = (
    ast.Expression,
    ast.BoolOp,
    ast.BinOp,
    ast.UnaryOp,
    ast.IfExp,
    ast.Compare,
    ast.Call,
    ast.keyword,
    ast.Constant,
    ast.Name,
    ast.Attribute,
    ast.Subscript,
    ast.Slice,
    ast.List,
    ast.Tuple,
    ast.Dict,
    ast.Set,
    ast.ListComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.comprehension,
    ast.JoinedStr,
    ast.FormattedValue,
    ast.Load,
    ast.Store,
    ast.And,
    ast.Or,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.LShift,
    ast.RShift,
    ast.BitOr,
    ast.BitXor,
    ast.BitAnd,
    ast.Invert,
    ast.Not,
    ast.UAdd,
    ast.USub,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Is,
    ast.IsNot,
    ast.In,
    ast.NotIn,
)


@lru_cache(maxsize=1024)
def _parse(expr: str) -> ast.Expression:
    # mode="eval" refuses statements outright: no assignment, import or second expression.
    return ast.parse(expr.strip(), mode="eval")


def _parsed(expr: str) -> ast.Expression:
    """`_parse`, with every way the parser refuses a text as an `ExpressionError`: a nesting too
    deep for it (`1+1+...` 100 000 times, a long unary chain) is RecursionError/MemoryError."""
    try:
        return _parse(expr)
    except SyntaxError as exc:
        raise ExpressionError(expr, f"syntax error: {exc.msg}") from exc
    except (RecursionError, MemoryError) as exc:
        raise ExpressionError(expr, "too deeply nested to parse") from exc


def power_too_large(base: Any, exponent: Any) -> bool:
    """Whether `base ** exponent` is an int over `MAX_POWER_BITS` bits, known before computing
    it: its bit length is about `exponent * log2(|base|)`. (Float powers overflow quickly on
    their own.)"""
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0:
        return False
    if abs(base) <= 1:
        return False
    # log2(|base|) >= 1 here, so a huge exponent is refused before it meets a float.
    return exponent > MAX_POWER_BITS or exponent * math.log2(abs(base)) > MAX_POWER_BITS


def compile_check(expr: str, *, roots: frozenset[str] = CONTEXT_ROOTS) -> None:
    """Refuse at load what `evaluate` would refuse for any context.

    Checks the syntax, the node types, the names (a context root, a comprehension variable),
    the calls (an allowed function or string method) and underscore attributes.
    """
    if not expr.strip():
        raise ExpressionError(expr, "empty expression")
    tree = _parsed(expr)
    nodes = list(ast.walk(tree))
    bound = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    callees = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    for node in nodes:
        if not isinstance(node, _ALLOWED_NODES):
            raise ExpressionError(expr, f"{type(node).__name__} is not allowed in expressions")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise ExpressionError(expr, f"attribute {node.attr!r} is not allowed")
        if isinstance(node, ast.Call):
            _check_call(expr, node)
        if (
            isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Load)
            and id(node) not in callees  # a called name is checked by _check_call
            and node.id not in roots
            and node.id not in bound
        ):
            known = ", ".join(sorted(roots))
            raise ExpressionError(expr, f"unknown name {node.id!r} (expressions see {known})")


def _check_call(expr: str, node: ast.Call) -> None:
    func = node.func
    if isinstance(func, ast.Name):
        if func.id not in FUNCTIONS:
            allowed = ", ".join(FUNCTIONS)
            raise ExpressionError(expr, f"function {func.id!r} is not allowed (only {allowed})")
    elif isinstance(func, ast.Attribute):
        if func.attr not in _STR_METHODS:
            raise ExpressionError(expr, f"method {func.attr!r} is not allowed")
    else:
        raise ExpressionError(expr, "only named functions can be called")


class _MissingField(InvalidExpression):  # type: ignore[misc]
    pass


_BUILDING_NODES: tuple[type[ast.AST], ...] = (
    ast.BinOp,
    ast.Call,
    ast.Subscript,
    ast.JoinedStr,
    ast.List,
    ast.Tuple,
    ast.Dict,
    ast.Set,
    ast.ListComp,
    ast.DictComp,
    ast.GeneratorExp,
)
"""The nodes whose value is built by the evaluation (a name or a field reads existing data)."""

_SIZED = (str, bytes, list, tuple, dict, set, frozenset)


class _Evaluator(EvalWithCompoundTypes):  # type: ignore[misc]
    """simpleeval with mapping-only attribute access, a fixed function list, a bounded `**`
    and a bound on what one evaluation builds."""

    def __init__(self, names: dict[str, Any]) -> None:
        super().__init__(functions=dict(FUNCTIONS), names=names)
        # The base class adds list/tuple/dict/set constructors; the contract is FUNCTIONS only.
        self.functions = dict(FUNCTIONS)
        self.operators[ast.Pow] = _power
        self.operators[ast.Mod] = _modulo
        self._built = 0

    def eval(self, expr: str, previously_parsed: ast.AST | None = None) -> Any:
        self._built = 0
        return super().eval(expr, previously_parsed)

    def _eval(self, node: ast.AST) -> Any:
        result = super()._eval(node)
        if isinstance(node, _BUILDING_NODES) and isinstance(result, _SIZED):
            self._built += len(result)
            if self._built > MAX_BUILT_ITEMS:
                raise IterableTooLong(
                    f"the expression builds over {MAX_BUILT_ITEMS} characters/items in all"
                )
        return result

    def _eval_formattedvalue(self, node: ast.FormattedValue) -> Any:
        # simpleeval formats first and measures after, so `f'{1:>1000000000}'` (or an
        # f-string of `[s] * n`) allocated it all before its length bound applied.
        value = self._eval(node.value)
        spec = self._eval(node.format_spec) if node.format_spec else ""
        if format_spec_size(spec) + text_size(value, MAX_STRING_LENGTH) > MAX_STRING_LENGTH:
            raise IterableTooLong(f"the f-string would be over {MAX_STRING_LENGTH} characters")
        return format(value, spec) if spec else value

    def _check_disallowed_items(self, item: Any) -> None:
        # The base walks every container it returns, which is O(size of `outputs`) per name
        # read. The context is plain data from a checkpoint; only a module could be harmful,
        # and nothing in the context or FUNCTIONS yields one.
        if isinstance(item, types.ModuleType):
            raise FeatureNotAvailable("modules are not allowed")

    def _eval_attribute(self, node: ast.Attribute) -> Any:
        if node.attr.startswith("_"):
            raise FeatureNotAvailable(f"attribute {node.attr!r} is not allowed")
        base = self._eval(node.value)
        if isinstance(base, Mapping):
            try:
                return base[node.attr]
            except KeyError:
                raise _MissingField(
                    f"{ast.unparse(node.value)} has no field {node.attr!r}"
                ) from None
        if isinstance(base, str) and node.attr in _STR_METHODS:
            return getattr(base, node.attr)
        raise FeatureNotAvailable(
            f"{ast.unparse(node.value)} is not a mapping ({type(base).__name__}):"
            f" it has no field {node.attr!r}"
        )


def _power(base: Any, exponent: Any) -> Any:
    """simpleeval's `safe_power` (operands within its MAX_POWER), the result within ours."""
    if power_too_large(base, exponent):
        raise NumberTooHigh(f"the power would be over {MAX_POWER_BITS} bits; not computed")
    return safe_power(base, exponent)


_LOCAL = threading.local()


def _evaluator(names: dict[str, Any]) -> _Evaluator:
    """This thread's evaluator with `names` in place. Building one (simpleeval's operator and
    node tables) cost more than evaluating a typical expression (issue 19's profile); `eval`
    resets its per-run state, and evaluation never awaits, so one per thread is never shared
    between two evaluations at once."""
    evaluator: _Evaluator | None = getattr(_LOCAL, "evaluator", None)
    if evaluator is None:
        evaluator = _LOCAL.evaluator = _Evaluator({})
    evaluator.names = names
    return evaluator


def spilled_hint(context: Mapping[str, Any]) -> str:
    """Why a field of an output may be missing: that output spilled (SPEC §2), and what is in
    its place is `{"$blob": KEY, "bytes": N}` (found by a walkthrough: `outputs.big.stdout`
    failed "'dict object' has no attribute 'stdout'" with no word of the spill)."""
    outputs = context.get("outputs")
    if not isinstance(outputs, Mapping):
        return ""
    spilled = sorted(
        str(name)
        for name, value in outputs.items()
        if isinstance(value, Mapping) and set(value) == {"$blob", "bytes"}
    )
    if not spilled:
        return ""
    names = ", ".join(f"outputs.{name}" for name in spilled)
    return (
        f" ({names}: over RUNFLEET_OUTPUT_CAP, kept in the blob store; only"
        ' {"$blob": KEY, "bytes": N} is in its place — write big results to a file and output'
        " its path)"
    )


def evaluate(expr: str, context: Mapping[str, Any]) -> Any:
    """The value of `expr` over `context`; any failure is an `ExpressionError` naming `expr`."""
    tree = _parsed(expr)
    evaluator = _evaluator(dict(context))
    try:
        value = evaluator.eval(expr, previously_parsed=tree.body)
        if text_size(value, MAX_RESULT_CHARS) > MAX_RESULT_CHARS:
            raise IterableTooLong(f"the value is over {MAX_RESULT_CHARS} characters as text")
        return value
    except InvalidExpression as exc:
        raise ExpressionError(expr, str(exc)) from exc
    except Exception as exc:
        # Anything the expression itself raised (ZeroDivisionError, TypeError, KeyError on a
        # subscript, ...): the expression failed, never the engine.
        hint = spilled_hint(context)
        raise ExpressionError(expr, f"{type(exc).__name__}: {exc}{hint}") from exc


def evaluate_condition(expr: str, context: Mapping[str, Any]) -> bool:
    """An edge's `when`: the truth of `evaluate(expr, context)`."""
    return bool(evaluate(expr, context))
