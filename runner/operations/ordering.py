"""The order a person reads a run's events in (SPEC §6.3, §10: `events`, the timeline).

Events are a projection, numbered in the order they were appended (§2). The publisher appends
`run_queued` only after the broker's PubAck (the event says the copy is on the queue; a replay
that stopped half-way relies on that), so a runner quick enough to claim the copy first appends
its `run_claimed` a few milliseconds earlier. Read as a story that is backwards; the fix is at
display, not at the source (appending `run_queued` before publishing would make it claim what
may never be on the queue, and every publish path — launch, resume, replay, the sweeper's
republish, the drain handoff — would need a compensating event): a `run_queued` of attempt N
is shown just before the first `run_claimed` of attempt N when it came after it. A fleet
resume's `run_resumed`, appended with its `run_queued` after the PubAck, moves with it (found
by an operator walkthrough: a quick run read "finished", then "resumed"). Each event keeps its
`seq`, so the numbers say what the store holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from store import Event

PUBLISHED = frozenset({"run_resumed", "run_queued"})
"""Appended after the publish they describe, so possibly after the claim of that publish."""


def queued_before_claimed(events: Sequence[Event]) -> list[Event]:
    """`events` with each `run_resumed`/`run_queued` moved before an earlier `run_claimed` of
    its attempt (in their own order)."""
    out: list[Event] = []
    first_claim: dict[int, int] = {}  # attempt -> index in `out` of its first run_claimed
    for event in events:
        if event.type in PUBLISHED and event.attempt in first_claim:
            at = first_claim[event.attempt]
            out.insert(at, event)
            first_claim = {a: i + 1 if i >= at else i for a, i in first_claim.items()}
            continue
        if event.type == "run_claimed" and event.attempt is not None:
            first_claim.setdefault(event.attempt, len(out))
        out.append(event)
    return out


def reading_times(events: Sequence[Event]) -> list[datetime]:
    """A time per event of `queued_before_claimed(...)`'s order that never decreases: each
    event's own time, or a later event's when that is earlier (a moved `run_queued` takes its
    claim's). What a merge by time with the delivery log sorts on: merging the moved list on
    the events' own times broke the merge's precondition and put deliveries before the events
    that caused them."""
    times: list[datetime] = []
    earliest: datetime | None = None
    for event in reversed(events):
        earliest = event.at if earliest is None or event.at < earliest else earliest
        times.append(earliest)
    times.reverse()
    return times
