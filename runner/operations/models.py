"""What the operations return (frozen dataclasses: in-process values, STYLE.md "data types").

Where a lower layer already has the typed answer, an operation returns it as is: a run is a
`RunDocument`, a page of runs a `RunPage`, a rewind a `RewindResult`, a DLQ record a `DlqRecord`,
`streams ensure` an `EnsureReport`. The types here are the answers that exist only at this level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from publisher.dlq import DlqRecord
from publisher.wire import RunMessage
from store import RunDocument, RunfleetError


@dataclass(frozen=True, slots=True)
class RecordDetail:
    """One DLQ record, its body decoded where it decodes, and its run as it is now."""

    record: DlqRecord
    body: bytes
    message: RunMessage | None
    """The decoded body; None when it does not decode (`undecodable` says why)."""
    undecodable: str | None
    run: RunDocument | None
    """None when the record names no run, or its run is gone (`run_missing`)."""

    @property
    def run_missing(self) -> bool:
        return self.record.run_id is not None and self.run is None


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """One record of a replay: the run it queued, or the error that kept the record."""

    record_id: int
    run: RunDocument | None = None
    error: RunfleetError | None = None

    @property
    def replayed(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ReplayReport:
    outcomes: tuple[ReplayOutcome, ...]
    not_attempted: tuple[int, ...] = ()
    """Records left alone after infrastructure failed (each would have failed alike)."""
    stopped_by: RunfleetError | None = None
    """The unreachable-infrastructure error that stopped the replay, if one did."""


@dataclass(frozen=True, slots=True)
class GcPlan:
    """What `collect_garbage` would delete: settled runs not updated since `cutoff`, and the
    DLQ records older than it whose run is gone or settled."""

    age: timedelta
    cutoff: datetime
    run_ids: tuple[str, ...]
    dlq_ids: tuple[int, ...] = ()
    dlq_kept: int = 0
    """Records as old whose run still waits on them (`failed_resumable DLQ_PARKED`: the record
    is its way back, `dlq replay`), kept."""
    dlq_error: RunfleetError | None = None
    """Why the DLQ was not read (NATS unreachable): no record is planned then."""


@dataclass(frozen=True, slots=True)
class GcReport:
    runs: int
    staged_uploads: int
    dlq_records: int
    dlq_error: RunfleetError | None = None
    """Why old DLQ records were not collected (NATS unreachable); the rest was."""
    dlq_kept: int = 0
    """Old records kept because their run still waits on them (`GcPlan.dlq_kept`)."""


@dataclass(frozen=True, slots=True)
class SweepResult:
    """One orphan-sweeper pass (SPEC §5.9): how many times it took each action."""

    actions: Mapping[str, int] = field(default_factory=dict)
