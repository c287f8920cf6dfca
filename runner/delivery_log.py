"""The delivery log (SPEC v2.2 §10b): what the broker's deliveries of a run became.

Every disposition a runner makes — ack, nak with its delay, DLQ with its record id, handoff,
hand-on, superseded, duplicate, busy, refused — and every claim is published as one small
message on `runfleet.deliveries.<run_id>` (stream `RUNFLEET_DELIVERIES`, limits retention, max
age `RUNFLEET_DELIVERY_LOG_TTL`). The run's events say what the *run* did; this log says what
happened to each *delivery*, including the ones that never touched the run: a superseded or
duplicate delivery writes nothing on its run (§13.2), so it can only be seen here.

The publish is core `nc.publish` to a subject the stream captures: fire-and-forget, no PubAck
awaited (nats-py has no unawaited `js.publish`). The log is evidence, never state: a publish
that fails is logged at debug and the delivery goes on as if nothing happened, and nothing
reads the log to decide anything.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import orjson
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from publisher.nats_errors import NATS_ERRORS, translate_nats_error
from publisher.wire import WireNames
from runner.deliveries import Delivery
from runner.metrics import RunnerMetrics
from store import UtcDatetime, utcnow
from store.timeutil import iso_z

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
UNATTRIBUTED = "_"
"""The subject token of a delivery whose run id is unknown or not a subject token (a message
that does not decode, or names a forged run id)."""
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_TOKEN = 256
"""The longest run id that names its own subject. A run id is a UUID (36 characters), but a
message may carry any string: a 20 000-character token is a valid subject token and past
nats-server's control-line limit (4 KiB), which the server answers with `-ERR` — and nats-py
closes the connection for good on that, with no reconnect. One such poison message killed the
runner that logged it (found by the poison fuzz)."""


class DeliveryEntry(BaseModel):
    """One line of the delivery log. `action` is the disposition as the runner's metrics count
    it (`ack`, `nak`, `dlq`, `handoff`, `none` when fenced) or `claim`; `reason` is its reason
    (`superseded`, `duplicate`, `busy`, `refused_budget`, `handed_on`, `transient`, …) or, for a
    claim, its path."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: int = SCHEMA_VERSION
    run_id: str | None
    stream_seq: int
    num_delivered: int
    attempt: int | None = None
    """The message's attempt, when it decoded (a superseded delivery carries an older one)."""
    action: str
    reason: str
    delay: float | None = None
    """Seconds, for a nak."""
    record_id: int | None = None
    """The DLQ record, for a dead-lettered or parked delivery."""
    runner: str
    at: UtcDatetime = Field(default_factory=utcnow)


def encode_entry(fields: dict[str, Any]) -> bytes:
    """An entry's JSON, the very bytes `DeliveryEntry(**fields).model_dump_json()` writes, from
    its fields in the model's order. Written by orjson without building the model: the values
    are the runner's own, and constructing and dumping the model cost 3 times as much, twice a
    run (issue 19). What orjson refuses (a lone surrogate) is written by `json`, escaped."""
    try:
        if fields["at"].microsecond:
            return orjson.dumps(fields, option=orjson.OPT_UTC_Z)
        # orjson drops a zero fraction (`…:11Z`) where `iso_z` keeps it, and the strings must
        # sort as the instants do (a review: one entry in a thousand, at a whole second).
        return orjson.dumps({**fields, "at": iso_z(fields["at"])})
    except TypeError:
        return json.dumps({**fields, "at": iso_z(fields["at"])}).encode()


def subject_token(run_id: str | None) -> str:
    """`run_id` when it can be a subject token of a sane length, else `UNATTRIBUTED` (the
    entry still carries the id)."""
    if run_id is not None and len(run_id) <= MAX_TOKEN and _TOKEN.match(run_id):
        return run_id
    return UNATTRIBUTED


class DeliveryLog:
    """A runner's writer of the log. `disposed` is the one call a disposition site (and the
    claim) makes: it counts the disposition in the runner's metrics (SPEC §5.8) and records it
    here."""

    def __init__(
        self, nc: Client, names: WireNames, runner: str, metrics: RunnerMetrics | None = None
    ) -> None:
        self.nc = nc
        self.names = names
        self.runner = runner
        self.metrics = metrics

    async def disposed(
        self,
        delivery: Delivery,
        action: str,
        reason: str,
        *,
        delay: float | None = None,
        record_id: int | None = None,
        counted: bool = True,
    ) -> None:
        """`counted=False`: record without counting — a claim, which the claims metric counts,
        is not a disposition."""
        if counted and self.metrics is not None:
            self.metrics.delivery(action, reason)
        message = delivery.message
        await self.record(
            message.run_id if message is not None else None,
            delivery.info.stream_seq,
            delivery.info.num_delivered,
            action,
            reason,
            delay=delay,
            record_id=record_id,
            attempt=message.attempt if message is not None else None,
        )

    async def record(
        self,
        run_id: str | None,
        seq: int,
        num_delivered: int,
        action: str,
        reason: str,
        *,
        delay: float | None = None,
        record_id: int | None = None,
        attempt: int | None = None,
        runner: str | None = None,
    ) -> None:
        """Publish one entry, fire-and-forget. Never raises but `CancelledError`."""
        try:
            fields = {
                "v": SCHEMA_VERSION,
                "run_id": run_id,
                "stream_seq": seq,
                "num_delivered": num_delivered,
                "attempt": attempt,
                "action": action,
                "reason": reason,
                "delay": delay,
                "record_id": record_id,
                "runner": runner or self.runner,
                "at": utcnow(),
            }
            subject = self.names.delivery_subject(subject_token(run_id))
            await self.nc.publish(subject, encode_entry(fields))
        except Exception as exc:  # noqa: BLE001 - the log must never affect a delivery
            log.debug("delivery log: seq %s %s/%s not recorded (%r)", seq, action, reason, exc)


async def read_deliveries(
    js: JetStreamContext, names: WireNames, run_id: str, *, after: int = 0
) -> list[tuple[int, DeliveryEntry]]:
    """A run's log entries after stream sequence `after`, in stream order, each with its
    sequence (to read on from). A missing stream (never ensured) reads as an empty log; an
    entry that does not parse is skipped. NATS failing is the typed error of
    `publisher.nats_errors` (`nats_unavailable`, `nats_timeout`, …), never a nats-py one."""
    token = subject_token(run_id)
    subject = names.delivery_subject(token)
    found: list[tuple[int, DeliveryEntry]] = []
    seq = after + 1
    while True:
        try:
            raw = await js.get_msg(names.delivery_stream, seq, subject=subject, next=True)
        except NotFoundError:  # no message after `seq`, or no stream: the log ends here
            return found
        except NATS_ERRORS as exc:
            raise translate_nats_error(exc, context=f"reading run {run_id}'s delivery log") from exc
        assert raw.seq is not None
        seq = raw.seq + 1
        try:
            entry = DeliveryEntry.model_validate_json(raw.data or b"")
        except ValidationError as exc:
            log.debug("delivery log: seq %s does not parse (%s)", raw.seq, exc)
            continue
        if token != run_id and entry.run_id != run_id:
            continue  # an id logged on the shared subject: only its own entries (`_`: all)
        found.append((raw.seq, entry))
