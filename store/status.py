"""The status machine (SPEC §2): the one table every status write consults.

A compare-and-set that writes `status` must also expect `status` (nothing writes a status
unconditionally), and every (expected, new) pair must be a row here, or the store raises
`IllegalTransition` before it touches the document.
"""

from __future__ import annotations

from collections.abc import Iterable

from store.errors import IllegalTransition
from store.models import RunStatus

S = RunStatus

_RESUMABLE = frozenset({S.PAUSED_WAITING_HUMAN, S.PAUSED_OPERATOR, S.FAILED_RESUMABLE, S.CANCELLED})
"""Statuses an operator may resume (SPEC §2 table)."""

TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    # fresh claim; operator cancel; LAUNCH_FAILED; a failed resume publish flips back to its
    # prior status; admission refusals and the backstop park; rewind of a queued run.
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED, S.FAILED} | _RESUMABLE),
    # every outcome of an execution; adoption re-claims a running run (running -> running).
    S.RUNNING: frozenset(
        {S.RUNNING, S.FINISHED, S.FAILED, S.FAILED_RESUMABLE, S.PAUSED_WAITING_HUMAN}
        | {S.PAUSED_OPERATOR, S.CANCELLED}
    ),
    # resume; auto-retry claim and local claim; cancel; rewind and budget re-park; DLQ park.
    S.FAILED_RESUMABLE: frozenset(
        {S.QUEUED, S.RUNNING, S.CANCELLED, S.PAUSED_OPERATOR, S.FAILED_RESUMABLE}
    ),
    S.PAUSED_WAITING_HUMAN: frozenset({S.QUEUED, S.RUNNING, S.CANCELLED, S.PAUSED_OPERATOR}),
    S.PAUSED_OPERATOR: frozenset({S.QUEUED, S.RUNNING, S.CANCELLED, S.PAUSED_OPERATOR}),
    S.CANCELLED: frozenset({S.QUEUED, S.RUNNING, S.PAUSED_OPERATOR}),
    # rewind is the only way back from a terminal failure.
    S.FAILED: frozenset({S.PAUSED_OPERATOR}),
    S.FINISHED: frozenset(),
}

OPERATOR_RESUMABLE = _RESUMABLE
TERMINAL = frozenset({S.FINISHED, S.FAILED})


def is_legal(current: RunStatus, new: RunStatus) -> bool:
    return new in TRANSITIONS[current]


def check_transitions(expected: Iterable[RunStatus], new: RunStatus) -> None:
    """Raise `IllegalTransition` unless every expected status may move to `new`."""
    for current in expected:
        if not is_legal(RunStatus(current), new):
            raise IllegalTransition(f"status {current} may not move to {new} (SPEC §2 table)")
