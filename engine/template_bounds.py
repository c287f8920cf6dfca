"""The work one `{{ }}` template may ask for, bounded (SPEC §6.1, §8).

Rendering is synchronous, on the runner's loop, so the work a template can ask for is bounded
(Jinja's sandbox guards access, not work), each refusal raised *before* the work is done:
- `**` refuses an int result over `expressions.MAX_POWER_BITS` bits, `*` a string/list/tuple
  over `MAX_SEQUENCE_LENGTH` items; `range` yields at most `MAX_RANGE` items per call and
  `MAX_RANGE_TOTAL` per render;
- a string one operation builds is at most `MAX_TEXT_LENGTH` characters, measured from the
  operands: `+`, `%`, `~` (Jinja compiles it to a plain join no sandbox hook sees, so
  `templates._CodeGenerator` emits a call to `bounded_concat`), every filter (a width, count or
  fill argument is checked first: `center`, `indent`, `wordwrap`, `replace`, `format`, `join`,
  `batch`, `slice`, `sum`), the string methods that grow (`center`, `ljust`, `replace`, `join`,
  `format`, ...) and a value rendered as text. A list may hold one item many times (`[v, v]`
  doubled 60 times), so a value's text is measured counting shared items each time they appear;
- one render may build at most `MAX_BUILT_ITEMS` items by `*` and `MAX_BUILT_CHARS`
  characters in all, iterate at most `MAX_ITERATIONS` times over its `for` loops, make at most
  `MAX_CALLS` calls and output at most `MAX_RENDERED_CHARS` characters; `lipsum` is gone.
The intercepted operators and the filters (which take the context) are not constant-folded
while compiling, where no budget applies. A refusal is a `TooMuchWork`, which `render` turns
into a `TemplateError` ("too much work").

The environment (`engine.templates`) calls into this module from its hooks; the per-render
totals live in a `Budget` that `render` installs in `LOCAL` for its thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jinja2.filters import make_attrgetter
from jinja2.runtime import Context
from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, pass_context, pass_environment

from engine.expressions import (
    MAX_POWER_BITS,
    format_spec_size,
    power_too_large,
    printf_size,
    text_size,
)

MAX_SEQUENCE_LENGTH = 100_000
"""The longest string/list/tuple a `*` may make (as simpleeval bounds expressions), and the
longest list a `+` may make."""

MAX_RANGE = 10_000
"""The most items one `range(...)` may yield."""

MAX_RANGE_TOTAL = 100_000
"""The most items all the `range(...)` calls of one render may yield together."""

MAX_BUILT_ITEMS = 10_000_000
"""The most items the `*`s (and list `+`s) of one render may make together."""

MAX_RENDERED_CHARS = 10_000_000
"""The longest text one render may produce."""

MAX_TEXT_LENGTH = MAX_RENDERED_CHARS
"""The longest string one operation may build (`~`, `+`, `%`, a filter, a string method, a
`format`, a value rendered as text). A longer one could never be output anyway, and a string
that doubles in a loop reaches it in a few dozen steps, long before the output bound would."""

MAX_BUILT_CHARS = 100_000_000
"""The most characters the operations of one render may build together. Ten strings of the
longest kind: a loop that appends to a string copies it each time, and this admits the usual
`ns.s = ns.s ~ item` over thousands of items while a copy this size stays a fraction of a
second of the runner's loop."""

MAX_ITERATIONS = 1_000_000
"""The most `for` iterations one render may make: loops nested over lists multiply work without
building anything (two over a 100 000-item list are 10**10)."""

MAX_CALLS = 100_000
"""The most calls (macros, `caller()`, methods, `loop(...)`) one render may make: a macro that
calls itself twice doubles its work per level. A macro call costs microseconds, so this is
under a second of the runner's loop."""


class Budget:
    """What one render has used so far; `render` installs a fresh one for its thread."""

    __slots__ = ("built", "calls", "chars", "iterations", "ranged")

    def __init__(self) -> None:
        self.built = 0
        self.calls = 0
        self.chars = 0
        self.iterations = 0
        self.ranged = 0


LOCAL = threading.local()
"""`LOCAL.budget`: the running render's `Budget`, which `render` installs for its thread."""


def _budget() -> Budget:
    # Outside `render` (no budget installed) only the per-operation bounds apply.
    budget: Budget | None = getattr(LOCAL, "budget", None)
    return budget if budget is not None else Budget()


class TooMuchWork(Exception):
    """A template asked for more work than the bounds allow."""


def bounded_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise TooMuchWork(f"range of {len(rng)} items (at most {MAX_RANGE})")
    budget = _budget()
    budget.ranged += len(rng)
    if budget.ranged > MAX_RANGE_TOTAL:
        raise TooMuchWork(f"the ranges of one render yield over {MAX_RANGE_TOTAL} items")
    return rng


def _charge_items(size: int, what: str) -> None:
    if size > MAX_SEQUENCE_LENGTH:
        raise TooMuchWork(f"{what} would make {size} items (at most {MAX_SEQUENCE_LENGTH})")
    budget = _budget()
    budget.built += size
    if budget.built > MAX_BUILT_ITEMS:
        raise TooMuchWork(f"one render's `*`s make over {MAX_BUILT_ITEMS} items")


def bounded_multiply(left: Any, right: Any) -> Any:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and isinstance(times, int):
            _charge_items(len(seq) * max(times, 0), f"repeating {type(seq).__name__}")
    # Squaring in a loop doubles the bits each round: 40 rounds make a 2**40-bit int.
    ints = isinstance(left, int) and isinstance(right, int)
    if ints and left.bit_length() + right.bit_length() > MAX_POWER_BITS + 1:
        raise TooMuchWork(f"the product would be over {MAX_POWER_BITS} bits; not computed")
    return left * right


def bounded_power(left: Any, right: Any) -> Any:
    if power_too_large(left, right):
        raise TooMuchWork(f"the power would be over {MAX_POWER_BITS} bits; not computed")
    return left**right


def _shown(obj: Any) -> Any:
    # A namespace's text is its attributes'.
    return object.__getattribute__(obj, "_Namespace__attrs") if isinstance(obj, Namespace) else obj


def text_length(value: Any) -> int:
    """How long `value` is as text, known before making it (past the bound: bound + 1)."""
    if isinstance(value, str):
        return len(value)
    return text_size(value, MAX_TEXT_LENGTH, unwrap=_shown)


def charge_text(size: int, what: str) -> None:
    """Refuse a string of `size` before it is built; count it toward the render's budget."""
    if size > MAX_TEXT_LENGTH:
        raise TooMuchWork(f"{what} would be over {MAX_TEXT_LENGTH} characters")
    budget = _budget()
    budget.chars += size
    if budget.chars > MAX_BUILT_CHARS:
        raise TooMuchWork(f"one render builds over {MAX_BUILT_CHARS} characters")


def _sum_sizes(values: Iterable[Any], start: int = 0) -> int:
    total = start
    for value in values:
        total += text_length(value)
        if total > MAX_TEXT_LENGTH:
            break
    return total


def bounded_concat(join: Callable[[Iterable[Any]], str], parts: tuple[Any, ...]) -> str:
    charge_text(_sum_sizes(parts), "the `~` concatenation")
    return join(parts)


def bounded_add(left: Any, right: Any) -> Any:
    if isinstance(left, str) and isinstance(right, str):
        charge_text(len(left) + len(right), "the `+` concatenation")
    elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
        _charge_items(len(left) + len(right), f"adding {type(left).__name__}s")
    return left + right


def bounded_modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        charge_text(printf_size(left, right, MAX_TEXT_LENGTH), "the `%` formatting")
    return left % right


class CountedIteration:
    """A loop's iterable, counting each iteration toward the render's `MAX_ITERATIONS`. It keeps
    the iterable's length, which `loop.length` and `loop.last` read."""

    __slots__ = ("_budget", "_items", "_iterator")

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = items
        self._iterator = iter(items)
        self._budget = _budget()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = next(self._iterator)
        self._budget.iterations += 1
        if self._budget.iterations > MAX_ITERATIONS:
            raise TooMuchWork(f"one render makes over {MAX_ITERATIONS} loop iterations")
        return item

    def __len__(self) -> int:
        return len(self._items)  # type: ignore[arg-type]  # TypeError is how LoopContext asks


def count_call() -> None:
    budget = _budget()
    budget.calls += 1
    if budget.calls > MAX_CALLS:
        raise TooMuchWork(f"one render makes over {MAX_CALLS} calls")


def _int(value: Any) -> int:
    # A non-int width makes the real call raise; it asks for nothing here.
    return value if isinstance(value, int) else 0


def _replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    size = text_length(text)
    if not (isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return size
    # A non-string is known only once it is text: at most one occurrence per character.
    found = size + 1 if not isinstance(text, str) or not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return size + found * (len(new) - len(old))


def _translate_size(text: str, table: Any) -> int:
    values = table.values() if isinstance(table, Mapping) else table
    longest = max((len(v) for v in values if isinstance(v, str)), default=1)
    return len(text) * max(longest, 1)


_GROWING_METHODS: Mapping[str, Callable[..., int]] = {
    "center": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "ljust": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "rjust": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "zfill": lambda s, width: max(len(s), _int(width)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(_int(tabsize), 0),
    "replace": _replace_size,
    "translate": _translate_size,
}
"""The string methods whose result can be far longer than their string: its size, from the
arguments. (`join` and `format` are measured apart; the others make at most a few times their
string.)"""


def checked_method_args(method: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Refuse a string method call whose result would be over the bound, before it is made."""
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name == "join" and args:
        items = list(args[0])  # measured, then joined: a generator is read once
        gaps = len(owner) * max(len(items) - 1, 0)
        charge_text(_sum_sizes(items, gaps), "str.join")
        return (items, *args[1:])
    if name in _GROWING_METHODS:
        charge_text(_GROWING_METHODS[name](owner, *args, **kwargs), f"str.{name}")
    return args


class BoundedFormatter(SandboxedFormatter):
    """`str.format` in a template: each field's width and value are measured before it is
    formatted, so `'{:>1000000000}'.format(1)` is refused, not allocated."""

    def __init__(self, env: Any, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._size = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._size += format_spec_size(format_spec) + text_length(value)
        if self._size > MAX_TEXT_LENGTH:
            raise TooMuchWork(f"the `format` would be over {MAX_TEXT_LENGTH} characters")
        return super().format_field(value, format_spec)


class BoundedEscapeFormatter(BoundedFormatter, SandboxedEscapeFormatter):
    pass


def _text_filter(name: str) -> Callable[..., Any]:
    """A check for a filter that turns its value into text (JSON, repr, escaped, ...)."""

    def check(value: Any, *args: Any, **kwargs: Any) -> Any:
        charge_text(text_length(value), f"the `{name}` filter")
        return value

    return check


def _check_center(value: Any, width: Any = 80) -> Any:
    charge_text(max(text_length(value), _int(width)), "the `center` filter")
    return value


def _check_indent(value: Any, width: Any = 4, first: Any = False, blank: Any = False) -> Any:
    size = text_length(value)
    lines = value.count("\n") + 1 if isinstance(value, str) else size + 1
    prefix = len(width) if isinstance(width, str) else max(_int(width), 0)
    charge_text(size + lines * prefix, "the `indent` filter")
    return value


def _check_wordwrap(
    value: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None, *_: Any
) -> Any:
    size = text_length(value)
    breaks = len(wrapstring) if isinstance(wrapstring, str) else 1
    lines = size // max(_int(width), 1) + (value.count("\n") if isinstance(value, str) else 0) + 1
    charge_text(size + lines * breaks, "the `wordwrap` filter")
    return value


def _check_replace(value: Any, old: Any, new: Any, count: Any = None) -> Any:
    charge_text(_replace_size(value, old, new, -1 if count is None else count), "`replace`")
    return value


def _check_format(value: Any, *args: Any, **kwargs: Any) -> Any:
    charge_text(text_length(value), "the `format` filter")
    fmt = value if isinstance(value, str) else str(value)
    charge_text(printf_size(fmt, kwargs or args, MAX_TEXT_LENGTH), "the `format` filter")
    return value


def _check_join(value: Any, d: Any = "", attribute: Any = None) -> Any:
    items = list(value)  # measured, then joined: a generator is read once
    gaps = (len(d) if isinstance(d, str) else 0) * max(len(items) - 1, 0)
    charge_text(_sum_sizes(items, gaps), "the `join` filter")  # an attribute is no longer
    return items


def _check_batch(value: Any, linecount: Any, fill_with: Any = None) -> Any:
    if fill_with is not None:  # the last batch is filled up to `linecount` items
        _charge_items(_int(linecount), "the `batch` filter's filling")
    return value


def _check_slice(value: Any, slices: Any, fill_with: Any = None) -> Any:
    _charge_items(_int(slices), "the `slice` filter")
    return value


_FILTER_CHECKS: Mapping[str, Callable[..., Any]] = {
    **{
        name: _text_filter(name)
        for name in (
            "string", "tojson", "pprint", "urlencode", "escape", "e", "forceescape", "safe",
            "xmlattr", "urlize", "upper", "lower", "title", "capitalize", "trim", "striptags",
            "wordcount", "truncate", "raw",
        )
    },
    "center": _check_center,
    "indent": _check_indent,
    "wordwrap": _check_wordwrap,
    "replace": _check_replace,
    "format": _check_format,
    "join": _check_join,
    "batch": _check_batch,
    "slice": _check_slice,
}  # fmt: skip
"""What a filter is checked for before it runs; every filter's text result is also counted."""


@pass_environment
def bounded_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """`sum`, which with a list `start` concatenates lists, copying the total each time."""
    values = list(iterable)
    if attribute is not None:
        getter = make_attrgetter(environment, attribute)
        values = [getter(v) for v in values]
    if isinstance(start, list | tuple):
        total = len(start) + sum(len(v) for v in values if isinstance(v, list | tuple))
        _charge_items(total, "the `sum`")
        if len(values) * total > MAX_BUILT_ITEMS:
            raise TooMuchWork(f"the `sum` would copy over {MAX_BUILT_ITEMS} items")
    return sum(values, start)


def bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, checked first (`_FILTER_CHECKS`) and its text result counted. It takes the
    context, which also keeps Jinja from running it while compiling, with constant arguments,
    where no render's budget applies."""
    check = _FILTER_CHECKS.get(name)
    passes = getattr(getattr(func, "jinja_pass_arg", None), "name", None)

    @pass_context
    def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        if check is not None:
            value = check(value, *args, **kwargs)
        if passes == "context":
            result = func(context, value, *args, **kwargs)
        elif passes == "eval_context":
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif passes == "environment":
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        if isinstance(result, str):
            charge_text(len(result), f"the `{name}` filter")
        return result

    return bounded
