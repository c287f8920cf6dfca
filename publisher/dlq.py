"""Dead-letter records (SPEC §3): one message per dead work-stream sequence on
`runfleet.dlq.<seq>` in the DLQ stream, whose `max_msgs_per_subject` of 1 makes recording twice
harmless. Bodies over 256 KiB go to the blob store at `dlq/<seq>.bin`. Nothing a runner cannot
decode is dropped: the raw bytes are kept (base64).

Infrastructure failures (a missing stream, a timeout) leave here as nats-py's own errors: the
runner's loops handle those as "retry shortly", and operator code translates them at its
boundary (`publisher.nats_errors`)."""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from publisher.errors import RecordNotFound
from publisher.wire import WireNames
from store import BlobStore, UtcDatetime, utcnow

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.api import RawStreamMsg

INLINE_BODY_MAX = 256 * 1024
_LIST_BATCH = 512
_LIST_FETCH_S = 1.0
_LIST_IDLE_S = 30.0


@dataclass(frozen=True, slots=True)
class _Read:
    """One DLQ message as `list` reads it (a delivery of its consumer, not a `get_msg`)."""

    data: bytes
    subject: str
    stream_seq: int
    at: datetime


_Reads = list[_Read]  # named here: inside `DlqStore`, `list` is its method


class DlqRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int = Field(ge=1, description="the work-stream sequence of the dead message")
    headers: dict[str, str] = Field(default_factory=dict)
    body_b64: str | None = None
    body_key: str | None = None
    body_bytes: int = 0
    run_id: str | None = None
    attempt: int | None = None
    reason: str
    detail: str = ""
    num_delivered: int = 0
    runner: str = ""
    at: UtcDatetime
    replayable: bool = True


UNREADABLE = "unreadable_record"
"""The reason shown for a record on the DLQ stream that does not read as a `DlqRecord`."""


def read_record(msg: RawStreamMsg) -> DlqRecord:
    """The record a DLQ message holds, or, when it does not read as one (written by hand, or
    by another version), a stand-in naming why, holding its raw bytes as its body and never
    replayable: one such message made every `dlq list` and the API's listing fail
    `internal` (found by a code review), and the operator could not even purge it."""
    return _record_of(msg.data or b"", msg.subject or "", msg.seq, msg.time)


def _record_of(data: bytes, subject: str, seq: int | None, at: datetime | None) -> DlqRecord:
    try:
        return DlqRecord.model_validate_json(data or b"{}")
    except ValueError as exc:  # pydantic's ValidationError, or JSON that does not parse
        tail = subject.rsplit(".", 1)[-1]
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return DlqRecord(
            id=int(tail) if tail.isdigit() and int(tail) >= 1 else seq or 1,
            body_b64=base64.b64encode(data).decode(),
            body_bytes=len(data),
            reason=UNREADABLE,
            detail=f"the record on {subject or 'the DLQ stream'} does not read: {problem}"
            " (its raw bytes are the body; purge it once read)",
            at=at or utcnow(),
            replayable=False,
        )


class DlqStore:
    def __init__(self, js: JetStreamContext, names: WireNames, blobs: BlobStore | None) -> None:
        self.js = js
        self.names = names
        self.blobs = blobs

    async def put(
        self,
        *,
        seq: int,
        body: bytes,
        headers: dict[str, str],
        reason: str,
        detail: str = "",
        run_id: str | None = None,
        attempt: int | None = None,
        num_delivered: int = 0,
        runner: str = "",
        replayable: bool = True,
    ) -> DlqRecord:
        record: dict[str, Any] = {
            "id": seq,
            "headers": headers,
            "body_bytes": len(body),
            "run_id": run_id,
            "attempt": attempt,
            "reason": reason,
            "detail": detail[:4000],
            "num_delivered": num_delivered,
            "runner": runner,
            "at": utcnow(),
            "replayable": replayable and run_id is not None,
        }
        if len(body) <= INLINE_BODY_MAX or self.blobs is None:
            record["body_b64"] = base64.b64encode(body).decode()
        else:
            key = f"dlq/{seq}.bin"
            await self.blobs.put_bytes(key, body)
            record["body_key"] = key
        model = DlqRecord.model_validate(record)
        await self.js.publish(self.names.dlq_subject(seq), model.model_dump_json().encode())
        return model

    async def get(self, record_id: int) -> DlqRecord:
        from nats.js.errors import NotFoundError  # nats-py only once connected (ADR-0024)

        from publisher.nats_errors import is_stream_missing

        try:
            msg = await self.js.get_last_msg(
                self.names.dlq_stream, self.names.dlq_subject(record_id)
            )
        except NotFoundError as exc:
            if is_stream_missing(exc):
                raise  # no DLQ stream is not "no record": the caller's boundary translates it
            raise RecordNotFound(f"no DLQ record {record_id}") from None
        return read_record(msg)

    async def body(self, record: DlqRecord) -> bytes:
        if record.body_b64 is not None:
            return base64.b64decode(record.body_b64)
        if record.body_key is not None and self.blobs is not None:
            return await self.blobs.get_bytes(record.body_key)
        return b""

    async def list(
        self, *, reason: str | None = None, older_than: datetime | None = None
    ) -> list[DlqRecord]:
        """Every record (with `reason`, older than `older_than`), by id. The HTTP API reads
        the DLQ whole for each page it serves, so this is read in bulk (`_read_all`)."""
        records: list[DlqRecord] = []
        for msg in await self._read_all():
            record = _record_of(msg.data, msg.subject, msg.stream_seq, msg.at)
            if reason is not None and record.reason != reason:
                continue
            if older_than is not None and record.at >= older_than:
                continue
            records.append(record)
        return sorted(records, key=lambda r: r.id)

    async def _read_all(self) -> _Reads:
        """The DLQ stream's messages, oldest first: most of them through an ephemeral consumer
        a batch at a time, then the rest from the stream's leader one `get_msg` at a time
        from the last one the consumer gave. One `get_msg` each was the whole read before
        (0.80 s for 5 000 records where the consumer takes 0.15 s, `bench/dlq_list.py`). The
        leader's read stays, for what the consumer cannot vouch for: an R1 consumer on a
        replicated stream may sit on a follower a record has not reached yet, and records
        deleted while it reads leave its pending count too high (its fetch then gives
        nothing). A missing stream raises JetStream's 404 (not "no records")."""
        from nats.js.errors import NotFoundError  # nats-py only once connected (ADR-0024)

        from publisher.nats_errors import is_stream_missing

        info = await self.js.stream_info(self.names.dlq_stream)
        if not info.state.messages:
            return []  # the usual DLQ: no consumer made for nothing
        got = await self._read_through_consumer()
        seq = (got[-1].stream_seq if got else 0) + 1
        while True:
            try:
                msg = await self.js.get_msg(
                    self.names.dlq_stream, seq=seq, subject=self.names.dlq_subject("*"), next=True
                )
            except NotFoundError as exc:
                if is_stream_missing(exc):
                    raise
                return got
            assert msg.seq is not None
            got.append(_Read(msg.data or b"", msg.subject or "", msg.seq, msg.time or utcnow()))
            seq = msg.seq + 1

    async def _read_through_consumer(self) -> _Reads:
        """What an ephemeral consumer over the record subjects delivers: no acks (it reads,
        never takes), in memory on one server, deleted at the end (a console refreshing its
        DLQ page would otherwise keep a dozen), and gone by itself `_LIST_IDLE_S` after a
        reader that died half-way. It stops at the first fetch that gives nothing."""
        import nats.errors
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=_LIST_IDLE_S,
        )
        psub = await self.js.pull_subscribe(
            self.names.dlq_subject("*"), stream=self.names.dlq_stream, config=config
        )
        got: _Reads = []
        try:
            pending = (await psub.consumer_info()).num_pending or 0
            while pending > 0:
                try:
                    msgs = await psub.fetch(min(pending, _LIST_BATCH), timeout=_LIST_FETCH_S)
                except (nats.errors.TimeoutError, TimeoutError):
                    break  # deleted since `pending` was counted, or slow: the leader reads on
                if not msgs:
                    break
                for msg in msgs:
                    meta = msg.metadata
                    got.append(_Read(msg.data, msg.subject, meta.sequence.stream, meta.timestamp))
                pending = msgs[-1].metadata.num_pending
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            if config.name:  # nats-py names the consumer it creates
                with contextlib.suppress(Exception):
                    await self.js.delete_consumer(self.names.dlq_stream, config.name)
        return got

    async def delete(self, record_id: int) -> bool:
        try:
            record = await self.get(record_id)
        except RecordNotFound:
            return False
        await self.js.purge_stream(self.names.dlq_stream, subject=self.names.dlq_subject(record_id))
        if record.body_key is not None and self.blobs is not None:
            await self.blobs.delete(record.body_key)
        return True
