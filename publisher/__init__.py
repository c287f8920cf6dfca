"""The queue contract (wire, streams, DLQ records) and the publisher: launch, resume, cancel,
replay (SPEC §3, §4)."""

from publisher.config import WireSettings
from publisher.connection import connect
from publisher.dlq import DlqRecord, DlqStore
from publisher.errors import (
    DuplicatePublication,
    MalformedMessage,
    NatsUnavailable,
    PublishFailed,
    RecordNotFound,
    RecordNotReplayable,
    ResumeTooLarge,
    RunNotCancellable,
    StaleRecord,
    StreamConfigConflict,
    UnsupportedSchema,
)
from publisher.publisher import Publisher
from publisher.streams import ensure_streams
from publisher.wire import SCHEMA_VERSION, ResumeCopy, RunMessage, WireNames, decode, encode

__all__ = [
    "SCHEMA_VERSION",
    "DlqRecord",
    "DlqStore",
    "DuplicatePublication",
    "MalformedMessage",
    "NatsUnavailable",
    "PublishFailed",
    "Publisher",
    "RecordNotFound",
    "RecordNotReplayable",
    "ResumeCopy",
    "ResumeTooLarge",
    "RunMessage",
    "RunNotCancellable",
    "StaleRecord",
    "StreamConfigConflict",
    "UnsupportedSchema",
    "WireNames",
    "WireSettings",
    "connect",
    "decode",
    "encode",
    "ensure_streams",
]
