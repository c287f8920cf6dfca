"""The reasons a DLQ filter accepts (`runner.operations.dlq.DLQ_REASONS`) are exactly those the
fleet writes on its records (SPEC §5.2, §5.6). The CLI and the API refuse any other reason, so a
reason written but not listed could not be filtered on, and one listed but never written would
be accepted only to match nothing. Read from the code that writes them, not from a copy."""

from __future__ import annotations

import ast
from pathlib import Path

from publisher.dlq import UNREADABLE
from runner.operations.dlq import DLQ_REASONS

ROOT = Path(__file__).resolve().parents[2]
WRITERS: dict[str, int] = {"dead_letter": 3, "_record": 4, "Dead": 0}
"""The calls that write a record, and the position of their `reason` argument."""


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def reasons_written() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "runner").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            candidates: list[ast.expr] = []
            index = WRITERS.get(name)
            if index is not None and len(node.args) > index:
                candidates.append(node.args[index])
            if name == "put":
                candidates += [k.value for k in node.keywords if k.arg == "reason"]
            found |= {
                c.value
                for c in candidates
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    return found


def test_the_reasons_a_filter_accepts_are_the_reasons_the_fleet_writes() -> None:
    # ...and the one a record that does not read is shown with (`publisher.dlq.read_record`).
    assert set(DLQ_REASONS) == reasons_written() | {UNREADABLE}
    assert len(DLQ_REASONS) == len(set(DLQ_REASONS))
