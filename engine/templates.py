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

The work a template may ask for is bounded, and why, in `engine.template_bounds`; a template
nested too deeply for Jinja's recursive compiler is a `TemplateError` too, not a `RecursionError`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateSyntaxError, meta, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import Markup

from engine.attachments import Unavailable
from engine.errors import TemplateError
from engine.expressions import CONTEXT_ROOTS, spilled_hint
from engine.template_bounds import (
    LOCAL,
    MAX_RENDERED_CHARS,
    BoundedEscapeFormatter,
    BoundedFormatter,
    Budget,
    CountedIteration,
    TooMuchWork,
    bounded_add,
    bounded_concat,
    bounded_filter,
    bounded_modulo,
    bounded_multiply,
    bounded_power,
    bounded_range,
    bounded_sum,
    charge_text,
    checked_method_args,
    count_call,
    text_length,
)

TEMPLATE_ROOTS: frozenset[str] = CONTEXT_ROOTS | {"attachments"}
"""The names a template may start from."""


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
    # Scalars first, charged by the text they make (short, or refused by Python's own int
    # digit limit); containers are sized before they are made text.
    if isinstance(value, str):
        charge_text(len(value), "the rendered value")
        return str(value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        text = str(value)
        charge_text(len(text), "the rendered value")
        return text
    charge_text(text_length(value), "the rendered value")
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)  # a StrictUndefined raises here, naming what is missing


def _raw(value: Any) -> _Raw:
    return _Raw(_to_text(value))


def _finalize_shell(value: Any) -> str:
    if isinstance(value, _Raw):
        charge_text(len(value), "the rendered value")
        return str(value)
    return shlex.quote(_to_text(value))


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, emitting a bounded `~` and a counted `for`.

    `~` compiles to a plain join of its parts (`str_join`), which no sandbox hook sees; here
    it calls `bounded_concat` with the same join. A `for` loop's iterable is wrapped so each
    iteration counts toward `MAX_ITERATIONS`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.bounded_concat({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.counted_iteration(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None


class _Environment(ImmutableSandboxedEnvironment):
    # Intercepted operators run through `call_binop` at render time, and Jinja does not
    # constant-fold them at compile time (where nothing could bound them).
    intercepted_binops = frozenset({"**", "*", "+", "%"})
    code_generator_class = _CodeGenerator

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals["range"] = bounded_range
        # `lipsum(n, min=, max=)` makes text of any size, and no workflow needs filler text.
        del self.globals["lipsum"]
        self.filters["sum"] = bounded_sum

    # What the code `_CodeGenerator` emits calls, as `environment.<name>(...)`.
    bounded_concat = staticmethod(bounded_concat)
    counted_iteration = staticmethod(CountedIteration)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            return bounded_power(left, right)
        if operator == "*":
            return bounded_multiply(left, right)
        if operator == "+":
            return bounded_add(left, right)
        if operator == "%":
            return bounded_modulo(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        count_call()
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (CountedIteration(args[0]), *args[1:])
        args = checked_method_args(obj, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(result, str):
            charge_text(len(result), "a call's result")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:  # not a string's `format`/`format_map`
            return None
        owner: str = value.__self__
        formatter = (
            BoundedEscapeFormatter(self, escape=owner.escape)
            if isinstance(owner, Markup)
            else BoundedFormatter(self)
        )
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if not is_map:
                return type(owner)(formatter.vformat(owner, args, kwargs))
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one positional argument")
            return type(owner)(formatter.vformat(owner, (), args[0]))

        return bounded

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
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
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
    LOCAL.budget = Budget()
    try:
        parts: list[str] = []
        size = 0
        for part in compiled.generate(data):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise TooMuchWork(f"the output is over {MAX_RENDERED_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    except TooMuchWork as exc:
        raise TemplateError(template, f"too much work: {exc}") from exc
    except Exception as exc:
        hint = spilled_hint(context)
        raise TemplateError(template, f"{type(exc).__name__}: {exc}{hint}") from exc
    finally:
        LOCAL.budget = None
