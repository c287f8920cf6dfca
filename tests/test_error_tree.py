"""The one exception tree: drawn in `store.errors`, declared one class a line, codes stable.

The drawing is what a person reads to find a code, so it is checked against the classes
themselves: every `RunfleetError` of the product packages, under its real parent, with its real
`code` — no more, no fewer.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import store.errors
from engine.failures import FailureCode
from engine.sandbox.errors import SandboxError, SandboxLost
from store.errors import RunfleetError

PACKAGES = ("store", "engine", "publisher", "runner")
_ROW = re.compile(r"^    (?P<rails>[│├└─ ]*)(?P<name>[A-Z]\w+)\s+(?P<code>[a-z][a-z0-9_]*)\b")


def live_tree() -> dict[str, tuple[str | None, str]]:
    """class name → (parent's name, code), for every product error (imported here, so a module
    nobody has imported yet still shows its errors)."""
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    tree: dict[str, tuple[str | None, str]] = {}
    todo: list[type[RunfleetError]] = [RunfleetError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] in PACKAGES:
            parent = next((b for b in cls.__bases__ if issubclass(b, RunfleetError)), None)
            tree[cls.__name__] = (parent.__name__ if parent else None, cls.code)
        todo.extend(cls.__subclasses__())
    return tree


def drawn_tree() -> dict[str, tuple[str | None, str]]:
    """The drawing in `store.errors`' docstring, read back: indentation is the parent."""
    doc = store.errors.__doc__ or ""
    tree: dict[str, tuple[str | None, str]] = {}
    parents: list[str] = []
    for line in doc.splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        depth = len(row["rails"]) // 4
        del parents[depth:]
        tree[row["name"]] = (parents[-1] if parents else None, row["code"])
        parents.append(row["name"])
    return tree


def test_the_drawn_tree_is_every_error_with_its_parent_and_code() -> None:
    live, drawn = live_tree(), drawn_tree()
    missing = {name: live[name] for name in live.keys() - drawn.keys()}
    extra = sorted(drawn.keys() - live.keys())
    wrong = {n: (drawn[n], live[n]) for n in live.keys() & drawn.keys() if drawn[n] != live[n]}
    assert not missing, f"draw these in store/errors.py's docstring (parent, code): {missing}"
    assert not extra, f"drawn in store/errors.py but no such error class: {extra}"
    assert not wrong, f"drawn (parent, code) vs the class's: {wrong}"


def test_an_error_class_that_states_no_code_is_refused_at_definition() -> None:
    with pytest.raises(TypeError, match="states no code"):

        class Forgetful(RunfleetError):  # would otherwise answer "runfleet_error"
            pass


def test_two_error_classes_cannot_share_a_code() -> None:
    with pytest.raises(TypeError, match=re.escape("already store.errors.StoreCorrupt's")):

        class Impostor(RunfleetError, code="store_corrupt"):
            pass


def test_a_code_is_snake_case() -> None:
    with pytest.raises(TypeError, match="not snake_case"):

        class Shouty(RunfleetError, code="Shouty-Code"):
            pass


def test_a_sandbox_error_named_by_its_failure_code_takes_that_name_as_its_code() -> None:
    class SandboxRateLimited(SandboxError, failure_code=FailureCode.RATE_LIMITED):
        """A driver that maps to one failure code needs no `code` of its own."""

    assert SandboxRateLimited.code == "rate_limited"
    assert SandboxRateLimited.failure_code is FailureCode.RATE_LIMITED
    assert (SandboxLost.code, SandboxLost.failure_code) == (
        "sandbox_lost",
        FailureCode.SANDBOX_LOST,
    )
