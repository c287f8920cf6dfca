"""Names `publisher` exports, imported when first used (`lazy_loader`, ADR-0024).

The runtime reads this stub for the map from name to module; type checkers read it as the
package's interface."""

from .config import WireSettings
from .connection import connect
from .dlq import DlqRecord, DlqStore
from .errors import (
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
from .publisher import Publisher
from .streams import ensure_streams
from .wire import SCHEMA_VERSION, ResumeCopy, RunMessage, WireNames, decode, encode

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
