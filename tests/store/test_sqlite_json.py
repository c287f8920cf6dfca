"""The SQLite store's JSON (issue 19): orjson writes a document when it writes it exactly, and
`json` writes everything else, as it always did; pydantic's own JSON reader reads a run, and
`json` reads what it cannot. Nothing a node may output is changed on the way: NaN, the
infinities, ints past 64 bits, lone surrogates."""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import Eq, RunStatus, Update
from store.models import Checkpoint, RunDocument
from store.protocols import RunQuery
from store.sqlite import SqliteRunStore
from store.sqlite.schema import dumps
from tests.store.conftest import MakeRun

ODD = {
    "nan": float("nan"),
    "inf": float("inf"),
    "minus_inf": float("-inf"),
    "big": 2**70,
    "minus_big": -(2**70),
    "lone_surrogate": "a\ud800b",
    "accents": "déjà vu ✓",
    "tiny": 5e-324,
}
"""Values orjson does not write exactly (or at all), beside ones it does."""


def same(a: Any, b: Any) -> bool:
    """Equality that takes NaN as equal to itself and tells an int from a float."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _raw_doc(path: Path, run_id: str) -> str:
    with closing(sqlite3.connect(path)) as conn:
        (text,) = conn.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return str(text)


@pytest.mark.parametrize("odd", [{k: v} for k, v in ODD.items()] + [ODD], ids=[*ODD, "all"])
async def test_outputs_orjson_cannot_write_exactly_are_stored_and_read_back_unchanged(
    tmp_path: Path, make_run: MakeRun, odd: dict[str, Any]
) -> None:
    """Each value alone (orjson writes a NaN as `null` without a word: only reading its text
    back catches that), then all together."""
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    try:
        doc = await store.create_run(make_run(status=RunStatus.RUNNING))
        written = await store.update_run(
            doc.run_id,
            [Eq("status", RunStatus.RUNNING)],
            Update(set={"checkpoint": Checkpoint(outputs={"a": dict(odd)}, progress=1)}),
        )
        assert isinstance(written, RunDocument)
        for read in (
            await store.get_run(doc.run_id),
            (await store.list_runs(RunQuery(statuses=[RunStatus.RUNNING]))).runs[0],
        ):
            assert read.checkpoint is not None
            assert same(read.checkpoint.outputs["a"], odd)
    finally:
        await store.close()


async def test_a_plain_run_is_written_by_orjson_and_reads_back_equal(
    tmp_path: Path, make_run: MakeRun
) -> None:
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    try:
        doc = await store.create_run(make_run(inputs={"n": [1, 2.5, {"deep": True}], "s": "é"}))
        raw = _raw_doc(tmp_path / "runs.db", doc.run_id)
        assert ", " not in raw and '"s":"é"' in raw  # compact, not ASCII-escaped
        assert await store.get_run(doc.run_id) == doc
    finally:
        await store.close()


_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(codec=None, blacklist_categories=()), max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), _JSONISH, max_size=5))
def test_dumps_writes_text_json_reads_back_as_the_very_document(value: dict[str, Any]) -> None:
    assert same(json.loads(dumps(value)), value)
