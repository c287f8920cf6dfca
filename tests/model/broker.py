"""An in-process double of the JetStream work queue runfleet relies on (SPEC §3, NOTES.md).

Exactly the behaviours the protocol relies on, each pinned against a real nats-server by
`test_broker_contract.py` (the same tests run on both):

- `publish` assigns consecutive stream sequences; a `Nats-Msg-Id` seen within the duplicate
  window answers `PubAck.duplicate` with the original sequence (even once that message is gone);
- one durable pull consumer with explicit ack: a delivery counts `num_delivered`; `ack` removes the
  message (work-queue retention); `nak(delay)` makes it deliverable again after the delay (a
  falsy delay: at once, as nats-py sends no delay then); `in_progress` restarts `ack_wait`; a
  delivery neither acked nor nak'd within `ack_wait` is redelivered;
- acks, naks and working acks act on the stream *sequence*, whichever delivery of it sends them
  (an old delivery's ack removes the message a later delivery is working on, SPEC §5.4);
- after `max_deliver` deliveries the message is not delivered again, stays in the stream, and one
  MAX_DELIVERIES advisory names it; the server notices this when it next looks for messages to
  deliver (a pull), so the double does it in `deliverable()` / `fetch()`; a late ack still
  removes it;
- `get_msg` / `delete_msg` by sequence, raising what nats-py raises for a missing sequence
  (`NotFoundError` 10037 for a read, `ServerError` 10057 for a delete);
- the stream's state (`first_seq`, `last_seq`, the deleted sequences between), as the stream
  info API answers it (`stream_state`; the sweeper's one look per pass, issue 19).

Time is a `Clock` the caller advances; nothing sleeps. Acks and naks on one delivery object are
refused a second time, as nats-py refuses them (`MsgAlreadyAckdError`).

The double has no leaders, but it models the one cluster difference that changes what a
consumer hands out: `consumer_leader_change()` (the contract tests call it where they step the
cluster's leaders down, so the double is held to the cluster's answer). On a three-node cluster
with the stream at three replicas (nats-server 2.15.1; the contract tests' cluster cases, each
with the stream's and the consumer's leader stepping down through the JetStream API in its
middle), every behaviour above held, and three differences were observed:

- a consumer leader change hands out *at once* a message redelivered less than `ack_wait` ago
  and not working-acked since: the replicated consumer state keeps the `ack_wait` clock of the
  first delivery (or of the last working ack), not of a later redelivery — a second holder
  early (`test_a_consumer_leader_change_redelivers_at_once_a_redelivery_not_working_acked`);
  the double models it (`consumer_leader_change`).
  The protocol's answer is the same as to any duplicate delivery: the lease fence (SPEC §13
  inv. 2), and the runner's first working ack after its claim closes the window;
- an acked message stays readable by `get_msg` for a few ms after the ack is answered (2-26 ms
  measured): the stream removes it through its own raft group (the tests' `removal_lag`). A
  reader sees a message that is going, never one that is gone coming back;
- right after a leader change the JetStream API may answer 503 or not at all for a moment (an
  election): a request is asked again, not taken as the behaviour under test. A SIGKILLed leader
  leaves the stream leaderless for raft's election timeout (3.5-7 s in the soaks): publishes get
  no responders, acks and pulls go unanswered (`tests/soak_cluster.py`, docs/reliability.md).

One more, seen by `tests/publisher/test_publish_cluster.py` rather than the contract tests: a
publish whose `Nats-Msg-Id` is *in process* (its copy proposed to the stream's raft group, not
yet committed) is refused `409 err_code 10158`, not answered `duplicate`; asked again a moment
later it is the duplicate. The double stores at once, so it never answers that (nor the 503s
and silences of an election: the publisher's and the runner's answers to those are tested on the
cluster itself, `tests/publisher/test_publish_cluster.py`, `tests/runner/test_disposition.py`).

The dedupe window, nak delays, working acks from an older delivery, the max-deliveries advisory
and an ack after it all survived the step-downs unchanged, which is why the model may run on a
double: the early redelivery is one more duplicate delivery, which the model already makes
(a second holder while the owner lives, and `duplicate()`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from nats.errors import MsgAlreadyAckdError
from nats.js.api import PubAck, RawStreamMsg
from nats.js.errors import NotFoundError, ServerError

MSG_ID = "Nats-Msg-Id"


@dataclass
class Clock:
    """Seconds since the start of an example; only ever moved forward by its owner."""

    now: float = 0.0

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self.now += seconds


@dataclass(frozen=True, slots=True)
class Advisory:
    """`$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`, the fields we read."""

    stream_seq: int
    deliveries: int


@dataclass
class _Message:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    delivered: int = 0
    due: float | None = None
    """While delivered and unacked: when it becomes deliverable again (ack deadline or nak)."""
    replicated_due: float | None = None
    """The deadline a clustered consumer's replicated state keeps: set by the first delivery, a
    working ack or a nak, never by a later redelivery (`consumer_leader_change`)."""
    exceeded: bool = False


@dataclass
class Delivered:
    """One delivery of a message, as a pull consumer hands it out."""

    queue: WorkQueue
    seq: int
    num_delivered: int
    data: bytes
    headers: dict[str, str]
    _ackd: bool = field(default=False, repr=False)

    def _check(self) -> None:
        if self._ackd:
            raise MsgAlreadyAckdError(self)

    def ack(self) -> None:
        self._check()
        self.queue.ack(self.seq)
        self._ackd = True

    def nak(self, delay: float | None = None) -> None:
        self._check()
        self.queue.nak(self.seq, delay)
        self._ackd = True

    def in_progress(self) -> None:
        self.queue.in_progress(self.seq)


class WorkQueue:
    """One work-queue stream with one durable pull consumer (explicit ack)."""

    def __init__(
        self,
        clock: Clock,
        *,
        stream: str = "RUNS",
        ack_wait: float = 32.0,
        max_deliver: int = 10,
        duplicate_window: float = 300.0,
    ) -> None:
        self.clock = clock
        self.stream = stream
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self.duplicate_window = duplicate_window
        self.advisories: list[Advisory] = []
        self._messages: dict[int, _Message] = {}
        self._ids: dict[str, tuple[int, float]] = {}
        self._last_seq = 0

    # -- publishing -------------------------------------------------------------------------

    def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> PubAck:
        headers = dict(headers or {})
        msg_id = headers.get(MSG_ID)
        now = self.clock.now
        if msg_id is not None and msg_id in self._ids:
            seq, at = self._ids[msg_id]
            if now - at < self.duplicate_window:
                return PubAck(stream=self.stream, seq=seq, duplicate=True)
        self._last_seq += 1
        seq = self._last_seq
        self._messages[seq] = _Message(seq, subject, bytes(data), headers)
        if msg_id is not None:
            self._ids[msg_id] = (seq, now)
        return PubAck(stream=self.stream, seq=seq)

    # -- the consumer ---------------------------------------------------------------------

    def deliverable(self) -> list[int]:
        """Sequences a pull would get now: redeliveries first (by due time), then messages
        never delivered (by sequence). A message whose last delivery ran out is marked
        exceeded here, with its advisory, as the server does when it looks for messages."""
        now = self.clock.now
        redeliveries: list[tuple[float, int]] = []
        fresh: list[int] = []
        for seq in sorted(self._messages):
            m = self._messages[seq]
            if m.exceeded:
                continue
            if m.due is None:
                fresh.append(seq)
            elif m.due <= now:
                if m.delivered >= self.max_deliver:
                    m.exceeded = True
                    m.due = None
                    self.advisories.append(Advisory(seq, m.delivered))
                else:
                    redeliveries.append((m.due, seq))
        return [seq for _, seq in sorted(redeliveries)] + fresh

    def deliver(self, seq: int) -> Delivered:
        """Hand out one deliverable message (a model may pick any of them: reordering)."""
        if seq not in self.deliverable():
            raise ValueError(f"sequence {seq} is not deliverable now")
        m = self._messages[seq]
        m.delivered += 1
        m.due = self.clock.now + self.ack_wait
        if m.delivered == 1:
            m.replicated_due = m.due
        return Delivered(self, seq, m.delivered, m.data, dict(m.headers))

    def fetch(self, batch: int = 1) -> list[Delivered]:
        return [self.deliver(seq) for seq in self.deliverable()[:batch]]

    def next_due(self) -> float | None:
        """When the next message becomes deliverable (or exceeded); None if nothing waits."""
        dues = [
            self.clock.now if m.due is None else m.due
            for m in self._messages.values()
            if not m.exceeded
        ]
        return min(dues, default=None)

    def ack(self, seq: int) -> None:
        """By sequence: also from an old delivery, and also after max_deliver."""
        self._messages.pop(seq, None)

    def nak(self, seq: int, delay: float | None = None) -> None:
        m = self._messages.get(seq)
        if m is None or m.exceeded or m.due is None:
            return
        m.due = m.replicated_due = self.clock.now + (delay or 0.0)

    def in_progress(self, seq: int) -> None:
        m = self._messages.get(seq)
        if m is None or m.exceeded or m.due is None:
            return
        m.due = m.replicated_due = self.clock.now + self.ack_wait

    def consumer_leader_change(self) -> list[int]:
        """What a clustered consumer does when its leader changes (nats-server 2.15.1, pinned by
        `test_a_consumer_leader_change_redelivers_at_once_a_redelivery_not_working_acked`): the
        new leader knows only the replicated deadline, so a message redelivered less than
        `ack_wait` ago and not working-acked since is deliverable again at once. Returns the
        sequences it made deliverable early."""
        early = []
        for m in self._messages.values():
            due, kept = m.due, m.replicated_due
            if due is not None and kept is not None and kept < due and not m.exceeded:
                m.due = kept
                early.append(m.seq)
        return early

    # -- the stream -------------------------------------------------------------------------

    def get_msg(self, seq: int) -> RawStreamMsg:
        m = self._messages.get(seq)
        if m is None:
            raise NotFoundError(code=404, err_code=10037, description="no message found")
        return RawStreamMsg(
            subject=m.subject, seq=m.seq, data=m.data, headers=dict(m.headers), stream=self.stream
        )

    def delete_msg(self, seq: int) -> bool:
        if self._messages.pop(seq, None) is None:
            raise ServerError(code=500, err_code=10057, description="no message found")
        return True

    def stream_state(self, *, deleted_details: bool = False) -> dict[str, object]:
        """The `state` of `$JS.API.STREAM.INFO.<stream>`: `first_seq` (the lowest sequence
        still held, or `last_seq + 1` when none is), `last_seq`, `num_deleted` (sequences
        removed between the two) and, when asked, `deleted`, their list."""
        held = sorted(self._messages)
        first = held[0] if held else self._last_seq + 1
        deleted = [s for s in range(first, self._last_seq + 1) if s not in self._messages]
        state: dict[str, object] = {
            "messages": len(held),
            "first_seq": first,
            "last_seq": self._last_seq,
            "num_deleted": len(deleted),
        }
        if deleted_details and deleted:
            state["deleted"] = deleted
        return state

    # -- for a model's eyes only ------------------------------------------------------------

    def sequences(self) -> list[int]:
        return sorted(self._messages)

    def state(self, seq: int) -> str:
        """`gone`, `exceeded`, `waiting` (never delivered), `pending` (delivered, unacked)."""
        m = self._messages.get(seq)
        if m is None:
            return "gone"
        if m.exceeded:
            return "exceeded"
        return "waiting" if m.due is None else "pending"


@dataclass
class _Reply:
    data: bytes


class StreamInfoApi:
    """The one JetStream API request runfleet makes on core NATS, `$JS.API.STREAM.INFO`,
    answered from a `WorkQueue` (what `publisher.queue_snapshot` sends and reads)."""

    def __init__(self, queue: WorkQueue) -> None:
        self.queue = queue

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5) -> _Reply:  # noqa: ASYNC109
        if not subject.endswith(f".STREAM.INFO.{self.queue.stream}"):
            raise ValueError(f"the double answers only its stream's info, not {subject}")
        details = bool(payload and json.loads(payload).get("deleted_details"))
        body = {"state": self.queue.stream_state(deleted_details=details)}
        return _Reply(json.dumps(body).encode())
