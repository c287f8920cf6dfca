"""`{{ }}` templates in `run:`, call `inputs` and messages (SPEC §6.1, §8), over Jinja2.

The environment is Jinja's immutable sandbox with `StrictUndefined`: a template cannot call
into Python objects or mutate the context, and a misspelt name is an error, never an empty
string silently passed to a shell. The one exception is `attachments`: an attachment the run
does not hold (or a field it lacks, like `url`) renders empty, as SPEC §8 asks.

In a shell command (`shell=True`) every `{{ value }}` is `shlex.quote`d by the `finalize` hook,
so a value with spaces or `;` stays one word and cannot inject a command. `{{ value | raw }}`
opts out: the filter wraps the text in a marker type that `finalize` passes through. (A missing
attachment therefore renders as `''`, an empty word, which keeps argument positions.)

Values render as text: `None` empty, bools `true`/`false`, dicts and lists as JSON.

Rendering is synchronous, on the runner's loop, so the work a template can ask for is bounded
(Jinja's sandbox guards access, not work): `**` refuses an int result over
`expressions.MAX_POWER_BITS` bits, `*` a string/list/tuple over `MAX_SEQUENCE_LENGTH` items (both
are intercepted, which also stops Jinja from constant-folding them while *compiling*, where
`{{ 3999999 ** 3999999 }}` hung the load), `range` yields at most `MAX_RANGE` items per call and
`MAX_RANGE_TOTAL` per render (so nested loops over ranges stay bounded), and one render may
build at most `MAX_BUILT_ITEMS` items by `*` and output at most `MAX_RENDERED_CHARS` characters.
A template nested too deeply for Jinja's recursive compiler is a `TemplateError`, not a
`RecursionError`.
"""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateSyntaxError, meta
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.attachments import Unavailable
from engine.errors import TemplateError
from engine.expressions import CONTEXT_ROOTS, MAX_POWER_BITS, power_too_large

TEMPLATE_ROOTS: frozenset[str] = CONTEXT_ROOTS | {"attachments"}
"""The names a template may start from."""

MAX_SEQUENCE_LENGTH = 100_000
"""The longest string/list/tuple a `*` may make (as simpleeval bounds expressions)."""

MAX_RANGE = 10_000
"""The most items one `range(...)` may yield."""

MAX_RANGE_TOTAL = 100_000
"""The most items all the `range(...)` calls of one render may yield together."""

MAX_BUILT_ITEMS = 10_000_000
"""The most items the `*`s of one render may make together."""

MAX_RENDERED_CHARS = 10_000_000
"""The longest text one render may produce."""


class _Budget:
    """What one render has used so far; `render` installs a fresh one for its thread."""

    __slots__ = ("built", "ranged")

    def __init__(self) -> None:
        self.built = 0
        self.ranged = 0


_LOCAL = threading.local()


def _budget() -> _Budget:
    # Outside `render` (no budget installed) only the per-operation bounds apply.
    budget: _Budget | None = getattr(_LOCAL, "budget", None)
    return budget if budget is not None else _Budget()


class _TooMuchWork(Exception):
    """A template asked for more work than the bounds allow."""


def _bounded_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise _TooMuchWork(f"range of {len(rng)} items (at most {MAX_RANGE})")
    budget = _budget()
    budget.ranged += len(rng)
    if budget.ranged > MAX_RANGE_TOTAL:
        raise _TooMuchWork(f"the ranges of one render yield over {MAX_RANGE_TOTAL} items")
    return rng


def _bounded_multiply(left: Any, right: Any) -> Any:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and isinstance(times, int):
            size = len(seq) * max(times, 0)
            if size > MAX_SEQUENCE_LENGTH:
                raise _TooMuchWork(
                    f"repeating {type(seq).__name__} would make {size} items"
                    f" (at most {MAX_SEQUENCE_LENGTH})"
                )
            budget = _budget()
            budget.built += size
            if budget.built > MAX_BUILT_ITEMS:
                raise _TooMuchWork(f"one render's `*`s make over {MAX_BUILT_ITEMS} items")
    return left * right


def _bounded_power(left: Any, right: Any) -> Any:
    if power_too_large(left, right):
        raise _TooMuchWork(f"the power would be over {MAX_POWER_BITS} bits; not computed")
    return left**right


class _Raw(str):
    """Text a template author asked not to quote (`| raw`)."""

    __slots__ = ()


class _Attachment:
    """One attachment's fields; a field it does not have renders empty."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self._fields = fields

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __getitem__(self, name: str) -> Any:
        value = self._fields.get(name, "")
        if isinstance(value, Unavailable):  # held, but no path this node can open (SPEC §8)
            raise value.error()
        return value

    def __bool__(self) -> bool:
        return bool(self._fields)

    def __str__(self) -> str:
        return str(self["path"])


class _Attachments:
    """`attachments.<name>`: an attachment the run does not hold renders empty (SPEC §8)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = items

    def __getattr__(self, name: str) -> _Attachment:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __getitem__(self, name: str) -> _Attachment:
        fields = self._items.get(name)
        return _Attachment(fields if isinstance(fields, Mapping) else {})

    def __bool__(self) -> bool:
        return bool(self._items)

    def __str__(self) -> str:
        return ""


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return str(value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)  # a StrictUndefined raises here, naming what is missing


def _raw(value: Any) -> _Raw:
    return _Raw(_to_text(value))


def _finalize_shell(value: Any) -> str:
    if isinstance(value, _Raw):
        return str(value)
    return shlex.quote(_to_text(value))


class _Environment(ImmutableSandboxedEnvironment):
    # Intercepted operators run through `call_binop` at render time, and Jinja does not
    # constant-fold them at compile time (where nothing could bound them).
    intercepted_binops = frozenset({"**", "*"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals["range"] = _bounded_range

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            return _bounded_power(left, right)
        if operator == "*":
            return _bounded_multiply(left, right)
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        # On a mapping, `.x` is the key `x` first: an output field named `items` or `keys` must
        # read the data, not the dict's method.
        if isinstance(obj, Mapping) and not attribute.startswith("_") and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def _environment(*, shell: bool) -> _Environment:
    env = _Environment(
        undefined=StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        finalize=_finalize_shell if shell else _to_text,
    )
    env.filters["raw"] = _raw
    return env


_SHELL_ENV = _environment(shell=True)
_PLAIN_ENV = _environment(shell=False)


def _env(shell: bool) -> _Environment:
    return _SHELL_ENV if shell else _PLAIN_ENV


@lru_cache(maxsize=512)
def _compiled(template: str, shell: bool) -> Template:
    try:
        return _env(shell).from_string(template)
    except TemplateSyntaxError as exc:
        raise TemplateError(template, exc.message or str(exc), lineno=exc.lineno) from exc
    except (RecursionError, MemoryError) as exc:
        raise TemplateError(template, "too deeply nested to compile") from exc


def compile_check(
    template: str, *, shell: bool = False, roots: frozenset[str] = TEMPLATE_ROOTS
) -> None:
    """Refuse at load a template that does not compile or starts from an unknown name."""
    _compiled(template, shell)
    env = _env(shell)
    try:
        undeclared = meta.find_undeclared_variables(env.parse(template))
    except (RecursionError, MemoryError) as exc:
        raise TemplateError(template, "too deeply nested to compile") from exc
    unknown = undeclared - roots - set(env.globals)
    if unknown:
        known = ", ".join(sorted(roots))
        names = ", ".join(repr(n) for n in sorted(unknown))
        raise TemplateError(template, f"unknown name {names} (templates see {known})")


def is_template(text: str) -> bool:
    """Whether `text` has any template syntax at all (plain strings skip rendering)."""
    return "{{" in text or "{%" in text or "{#" in text


def render(template: str, context: Mapping[str, Any], *, shell: bool) -> str:
    """Render `template` over `context`; with `shell=True`, values are shell-quoted.

    Any failure (syntax, an undefined name, a sandbox refusal, an error in a filter) is a
    `TemplateError` naming the template.
    """
    compiled = _compiled(template, shell)
    data = dict(context)
    data["attachments"] = _Attachments(context.get("attachments") or {})
    _LOCAL.budget = _Budget()
    try:
        parts: list[str] = []
        size = 0
        for part in compiled.generate(data):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise _TooMuchWork(f"the output is over {MAX_RENDERED_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    except _TooMuchWork as exc:
        raise TemplateError(template, f"too much work: {exc}") from exc
    except Exception as exc:
        raise TemplateError(template, f"{type(exc).__name__}: {exc}") from exc
    finally:
        _LOCAL.budget = None
