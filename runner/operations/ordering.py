"""The order a person reads a run's events in (SPEC §6.3, §10: `events`, the timeline).

Events are a projection, numbered in the order they were appended (§2). The publisher appends
`run_queued` only after the broker's PubAck (the event says the copy is on the queue; a replay
that stopped half-way relies on that), so a runner quick enough to claim the copy first appends
its `run_claimed` a few milliseconds earlier. Read as a story that is backwards; the fix is at
display, not at the source (appending `run_queued` before publishing would make it claim what
may never be on the queue, and every publish path — launch, resume, replay, the sweeper's
republish, the drain handoff — would need a compensating event): a `run_queued` of attempt N
is shown just before the first `run_claimed` of attempt N when it came after it. Each event
keeps its `seq`, so the numbers say what the store holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from store import Event


def queued_before_claimed(events: Sequence[Event]) -> list[Event]:
    """`events` with each `run_queued` moved before an earlier `run_claimed` of its attempt."""
    out: list[Event] = []
    first_claim: dict[int, int] = {}  # attempt -> index in `out` of its first run_claimed
    for event in events:
        if event.type == "run_queued" and event.attempt in first_claim:
            at = first_claim[event.attempt]
            out.insert(at, event)
            first_claim = {a: i + 1 if i >= at else i for a, i in first_claim.items()}
            continue
        if event.type == "run_claimed" and event.attempt is not None:
            first_claim.setdefault(event.attempt, len(out))
        out.append(event)
    return out
