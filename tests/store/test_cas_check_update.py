"""`check_update` remembers the shapes of writes it has allowed (issue 19): a write of a shape
seen before is not checked again. A shape is its paths, its status conditions and the status it
sets, so nothing a rule refuses can pass as a remembered shape."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.cas import Eq, In, Ne, Update, _check_update, check_update
from store.errors import IllegalTransition, UnwritablePath
from store.models import RunStatus

STATUSES = st.sampled_from(list(RunStatus))
PATHS = st.sampled_from(
    ["status", "lease", "lease.expires_at", "checkpoint", "error", "run_id", "nope", "version"]
)


def test_a_legal_write_then_an_illegal_transition_on_the_same_paths_is_refused() -> None:
    paths = {"failure_code": None, "error": None}
    check_update(
        [Eq("status", RunStatus.QUEUED)], Update(set={"status": RunStatus.RUNNING, **paths})
    )
    with pytest.raises(IllegalTransition):
        check_update(
            [Eq("status", RunStatus.FAILED)], Update(set={"status": RunStatus.RUNNING, **paths})
        )
    with pytest.raises(IllegalTransition):  # the same paths, and no status condition at all
        check_update([Eq("attempt", 1)], Update(set={"status": RunStatus.RUNNING, **paths}))


def test_a_refused_shape_is_refused_every_time() -> None:
    for _ in range(3):
        with pytest.raises(UnwritablePath):
            check_update([], Update(set={"lease": None, "lease.expires_at": 1}))


def test_an_unhashable_status_value_is_checked_not_remembered() -> None:
    with pytest.raises((IllegalTransition, ValueError)):
        check_update([Eq("status", RunStatus.QUEUED)], Update(set={"status": ["running"]}))


@settings(max_examples=400, deadline=None)
@given(
    paths=st.lists(PATHS, max_size=3, unique=True),
    unset=st.lists(PATHS, max_size=2, unique=True),
    expected=st.one_of(st.none(), STATUSES, st.lists(STATUSES, min_size=1, max_size=3)),
    new=st.one_of(st.none(), STATUSES),
    twice=st.booleans(),
)
def test_check_update_answers_as_the_full_check_does(
    paths: list[str],
    unset: list[str],
    expected: RunStatus | list[RunStatus] | None,
    new: RunStatus | None,
    twice: bool,
) -> None:
    """Remembered or not, the answer is the full check's."""
    conditions: list[Any] = [Ne("attempt", 0)]
    if isinstance(expected, list):
        conditions.append(In("status", tuple(expected)))
    elif expected is not None:
        conditions.append(Eq("status", expected))
    fields: dict[str, Any] = dict.fromkeys(paths, 1)
    if new is not None:
        fields["status"] = new
    update = Update(set=fields, unset=unset)

    def answer(check: Any) -> str:
        try:
            check(conditions, update)
        except (IllegalTransition, UnwritablePath, ValueError) as exc:
            return type(exc).__name__
        return "allowed"

    want = answer(_check_update)
    for _ in range(2 if twice else 1):
        assert answer(check_update) == want
