"""`apply_update` copies only what it changes; the stored document it was given is untouched; a
set under a present parent that is not a sub-document is refused, as `mongod` refuses it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.cas import Update, apply_update
from store.errors import UnwritablePath

KEYS = st.sampled_from(["a", "b", "c"])
LEAVES = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3))
DOCS = st.recursive(
    st.dictionaries(KEYS, LEAVES, max_size=3),
    lambda inner: st.dictionaries(KEYS, st.one_of(LEAVES, inner), max_size=3),
    max_leaves=12,
)
PATHS = st.lists(KEYS, min_size=1, max_size=3).map(".".join)


def reference(doc: dict[str, Any], update: Update, now_ms: int) -> dict[str, Any]:
    """The obvious implementation: deep-copy everything, then walk."""
    out = copy.deepcopy(doc)
    for path, value in update.set.items():
        *parents, last = path.split(".")
        cur = out
        for part in parents:
            if part not in cur:
                cur[part] = {}
            elif not isinstance(cur[part], dict):
                raise UnwritablePath(path)
            cur = cur[part]
        cur[last] = value
    for path in update.unset:
        *parents, last = path.split(".")
        cur: Any = out
        for part in parents:
            cur = cur.get(part) if isinstance(cur, dict) else None
        if isinstance(cur, dict):
            cur.pop(last, None)
    if update.bump_version:
        out["version"] = int(out.get("version", 1)) + 1
        out["updated_at"] = now_ms
    return out


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=DOCS,
    sets=st.dictionaries(PATHS, LEAVES, max_size=3),
    unsets=st.lists(PATHS, max_size=3),
    bump=st.booleans(),
)
def test_apply_update_equals_a_deep_copy_walk_and_leaves_the_input_alone(
    doc: dict[str, Any], sets: dict[str, Any], unsets: list[str], bump: bool
) -> None:
    doc = {**doc, "version": 3}
    before = copy.deepcopy(doc)
    update = Update(set=sets, unset=unsets, bump_version=bump)
    try:
        expected = reference(doc, update, 42)
    except UnwritablePath:
        with pytest.raises(UnwritablePath):
            apply_update(doc, update, 42)
    else:
        assert apply_update(doc, update, 42) == expected
    assert doc == before


def test_apply_update_shares_the_untouched_subdocuments() -> None:
    doc = {"checkpoint": {"vars": {"x": 1}}, "lease": {"token": "t", "expires_at": 1}}
    out = apply_update(doc, Update(set={"lease.expires_at": 2}, bump_version=False), 0)
    assert out["lease"] == {"token": "t", "expires_at": 2}
    assert doc["lease"]["expires_at"] == 1
    assert out["checkpoint"] is doc["checkpoint"]
