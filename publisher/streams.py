"""`ensure_streams`: create or update the streams and consumers of SPEC §3, idempotently.

JetStream cannot change some settings in place (a stream's retention or storage, a consumer's
ack policy); rather than silently leave a stream that contradicts the contract, we refuse with
`StreamConfigConflict` naming the setting.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from publisher.config import WireSettings
from publisher.errors import StreamConfigConflict
from publisher.wire import WireNames

SEVEN_DAYS = 7 * 24 * 3600.0
SERVER_DEFAULT_DUPLICATE_WINDOW = 120.0
"""Stated explicitly: left at 0 the server applies 2 min, and every ensure would "update"."""


@dataclass(frozen=True, slots=True)
class EnsureReport:
    created: list[str]
    updated: list[str]
    changes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """What an update changed, by name: `max_deliver 3 -> 10` (what an operator must carry
    to every runner, SPEC §3)."""


def runs_stream_config(names: WireNames, s: WireSettings) -> StreamConfig:
    return StreamConfig(
        name=names.runs_stream,
        subjects=[names.runs_subject],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=0,
        duplicate_window=s.duplicate_window.total_seconds(),
        num_replicas=s.stream_replicas,
    )


def runners_consumer_config(names: WireNames, s: WireSettings) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=names.consumer,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=s.effective_ack_wait.total_seconds(),
        max_deliver=s.max_deliver,
        # -1: messages waiting out a nak delay count against the limit, and a finite one
        # would stop new launches during a capacity outage (SPEC §3).
        max_ack_pending=-1,
        filter_subject=names.runs_subject,
    )


def advisory_stream_config(names: WireNames, s: WireSettings) -> StreamConfig:
    return StreamConfig(
        name=names.advisory_stream,
        subjects=[names.advisory_subject],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=SEVEN_DAYS,
        duplicate_window=SERVER_DEFAULT_DUPLICATE_WINDOW,
        num_replicas=s.stream_replicas,
    )


def backstop_consumer_config(names: WireNames) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=names.backstop_consumer,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=-1,
        max_ack_pending=-1,
    )


def dlq_stream_config(names: WireNames, s: WireSettings) -> StreamConfig:
    return StreamConfig(
        name=names.dlq_stream,
        subjects=[names.dlq_subject("*")],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msgs_per_subject=1,
        max_age=0,
        duplicate_window=SERVER_DEFAULT_DUPLICATE_WINDOW,
        num_replicas=s.stream_replicas,
    )


def delivery_stream_config(names: WireNames, s: WireSettings) -> StreamConfig:
    """The delivery log (SPEC v2.2 §10b): what runners did with each delivery, kept for
    `RUNFLEET_DELIVERY_LOG_TTL`. Limits retention, never read by a consumer that acks."""
    return StreamConfig(
        name=names.delivery_stream,
        subjects=[names.delivery_subject("*")],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=s.delivery_log_ttl.total_seconds(),
        # The server refuses a duplicate window longer than the max age.
        duplicate_window=min(SERVER_DEFAULT_DUPLICATE_WINDOW, s.delivery_log_ttl.total_seconds()),
        num_replicas=s.stream_replicas,
    )


async def _ensure_stream(js: JetStreamContext, want: StreamConfig, report: EnsureReport) -> None:
    assert want.name is not None
    try:
        info = await js.stream_info(want.name)
    except NotFoundError:
        await js.add_stream(want)
        report.created.append(want.name)
        return
    have = info.config
    for field in ("retention", "storage"):
        if getattr(have, field) != getattr(want, field):
            raise StreamConfigConflict(
                f"stream {want.name}: {field} is {getattr(have, field)}, the contract says"
                f" {getattr(want, field)}"
            )
    if _differs(have, want):
        await js.update_stream(want)
        report.updated.append(want.name)
        report.changes[want.name] = _changes(have, want)


async def _ensure_consumer(
    js: JetStreamContext, stream: str, want: ConsumerConfig, report: EnsureReport
) -> None:
    assert want.durable_name is not None
    label = f"{stream}/{want.durable_name}"
    try:
        info = await js.consumer_info(stream, want.durable_name)
    except NotFoundError:
        await js.add_consumer(stream, want)
        report.created.append(label)
        return
    have = info.config
    if have.ack_policy != want.ack_policy:
        raise StreamConfigConflict(f"consumer {label}: ack policy is {have.ack_policy}")
    if _differs(have, want):
        await js.add_consumer(stream, want)  # same durable: the server updates it in place
        report.updated.append(label)
        report.changes[label] = _changes(have, want)


def _differs(have: object, want: object) -> bool:
    return bool(_changes(have, want))


def _changes(have: object, want: object) -> list[str]:
    """`field old -> new` for each field `want` sets that `have` does not hold."""
    out: list[str] = []
    for field, value in vars(want).items():
        if value is None:
            continue
        current = getattr(have, field, None)
        if isinstance(value, float) or isinstance(current, float):
            if current is None or abs(float(current) - float(value)) > 1e-6:
                out.append(f"{field} {current} -> {value}")
        elif current != value:
            out.append(f"{field} {_shown(current)} -> {_shown(value)}")
    return out


def _shown(value: object) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


async def ensure_streams(
    js: JetStreamContext, names: WireNames, settings: WireSettings
) -> EnsureReport:
    report = EnsureReport([], [])
    await _ensure_stream(js, runs_stream_config(names, settings), report)
    await _ensure_consumer(js, names.runs_stream, runners_consumer_config(names, settings), report)
    await _ensure_stream(js, advisory_stream_config(names, settings), report)
    await _ensure_consumer(js, names.advisory_stream, backstop_consumer_config(names), report)
    await _ensure_stream(js, dlq_stream_config(names, settings), report)
    await _ensure_stream(js, delivery_stream_config(names, settings), report)
    return report


async def leaderless(js: JetStreamContext, names: WireNames) -> list[str]:
    """The streams and consumers of `ensure_streams` that have no raft leader now. A
    cluster's `/healthz` answers ok before every group has elected, and a publish or a pull
    meanwhile goes unanswered: a fleet starting on a cluster waits until this is empty
    (`runner.embedded`). Asked of a cluster only (one server has no raft groups to wait for)."""
    missing: list[str] = []
    for stream in (
        names.runs_stream,
        names.advisory_stream,
        names.dlq_stream,
        names.delivery_stream,
    ):
        info = await js.stream_info(stream)
        if info.cluster is None or not info.cluster.leader:
            missing.append(f"stream {stream}")
    for stream, consumer in (
        (names.runs_stream, names.consumer),
        (names.advisory_stream, names.backstop_consumer),
    ):
        cinfo = await js.consumer_info(stream, consumer)
        if cinfo.cluster is None or not cinfo.cluster.leader:
            missing.append(f"consumer {consumer}")
    return missing
