"""`QueueSnapshot`: which sequences are still on a work-queue stream, from one stream-info request.

The sweeper asks whether a run's copy is gone (SPEC §5.9). One `get_msg` per queued run made a
pass over a 50 000-run backlog cost 50 000 round trips (issue 19). A work-queue stream removes a
message when it is acked or deleted, so its state — `first_seq`, `last_seq` and the sequences
deleted in between — answers every such question at once. nats-py 2.16's `stream_info` does not
send the API's `deleted_details` flag, so the request is made on the JetStream API subject
itself (`$JS.API.STREAM.INFO.<stream>`, the documented wire API).

Only "gone" is ever acted on, and a sequence once gone never comes back, so a snapshot is safe
however old: a copy it shows present may have gone since (the next pass sees it), and a sequence
past its `last_seq` is not known (`None`: ask `get_msg`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from nats.js.errors import APIError

API_PREFIX = "$JS.API"
MAX_LISTED = 200_000
"""Beyond this many interior deletions the list is not asked for (≈ 7 bytes each in the
reply): a snapshot then knows only `first_seq`/`last_seq`, and the rest is asked one by one."""


class Requester(Protocol):
    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,  # noqa: ASYNC109
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    first_seq: int
    last_seq: int
    deleted: frozenset[int] | None
    """Sequences between `first_seq` and `last_seq` no longer on the stream; None: not listed."""

    def gone(self, seq: int) -> bool | None:
        """True: the message was removed before the snapshot. False: it was on the stream.
        None: the snapshot cannot say (published after it, or deletions not listed)."""
        if seq > self.last_seq:
            return None
        if seq < self.first_seq:
            return True
        if self.deleted is None:
            return None
        return seq in self.deleted


async def queue_snapshot(
    nc: Requester,
    stream: str,
    *,
    max_listed: int = MAX_LISTED,
    timeout: float = 5.0,  # noqa: ASYNC109 - a request timeout, as nats-py's
) -> QueueSnapshot:
    """The stream's state now. Two small requests when it has interior deletions (their count
    first, then the list if it is not too long), one when it has none. API errors raise what
    nats-py raises for them (`NotFoundError` for an unknown stream)."""
    subject = f"{API_PREFIX}.STREAM.INFO.{stream}"
    state = await _state(nc, subject, details=False, timeout=timeout)
    deleted: frozenset[int] | None = None
    if not state.get("num_deleted"):
        deleted = frozenset()
    elif int(state["num_deleted"]) <= max_listed:
        state = await _state(nc, subject, details=True, timeout=timeout)
        deleted = frozenset(int(s) for s in state.get("deleted") or ())
    return QueueSnapshot(int(state["first_seq"]), int(state["last_seq"]), deleted)


async def _state(nc: Requester, subject: str, *, details: bool, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
    payload = json.dumps({"deleted_details": True}).encode() if details else b""
    msg = await nc.request(subject, payload, timeout=timeout)
    body = json.loads(msg.data)
    if "error" in body:
        APIError.from_error(body["error"])  # raises the typed error
    state: dict[str, Any] = body["state"]
    return state
