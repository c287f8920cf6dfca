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
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateSyntaxError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.attachments import Unavailable
from engine.errors import TemplateError
from engine.expressions import CONTEXT_ROOTS

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


def compile_check(
    template: str, *, shell: bool = False, roots: frozenset[str] = TEMPLATE_ROOTS
) -> None:
    """Refuse at load a template that does not compile or starts from an unknown name."""
    _compiled(template, shell)
    env = _env(shell)
    unknown = meta.find_undeclared_variables(env.parse(template)) - roots - set(env.globals)
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
    try:
        return compiled.render(data)
    except Exception as exc:
        raise TemplateError(template, f"{type(exc).__name__}: {exc}") from exc
