"""The runner process's start-up heap is frozen (runner/heap.py): what that may and may not do."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from runner.heap import freeze_startup_heap


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's heap is not a runner's


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freezing_the_startup_heap_hides_it_from_collections_but_later_cycles_are_reclaimed(
    unfrozen_after: None,
) -> None:
    before = _Node()
    frozen = freeze_startup_heap()
    assert frozen > 0 and gc.get_freeze_count() == frozen
    assert not any(o is before for o in gc.get_objects(generation=2))  # never walked again

    # A reference cycle made while serving (one per delivery, say) is still collected.
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
