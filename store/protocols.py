"""The seams: `RunStore` (runs, events, interactions, staged-upload records, locks) and
`BlobStore` (bytes). SPEC §9.

Every method is a single-document atomic operation, so a standalone `mongod` (no replica set,
no transactions) gives the same guarantees as SQLite. Anything a claim or a resume must see
lives on the run document; events, interactions and staged-upload records are projections written
after it and repaired by re-running the action that wrote them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from store.cas import CasConflict, Condition, Update, to_storage
from store.models import (
    Event,
    Interaction,
    Origin,
    RunDocument,
    RunStatus,
    StagedUpload,
)


@dataclass(frozen=True, slots=True)
class RunQuery:
    """Filters for `RunStore.list_runs`; every given filter must hold. Paging is keyset on
    `run_id` (time-ordered UUIDv7), so a page is stable while runs are being created."""

    statuses: Sequence[RunStatus] = ()
    tenant: str | None = None
    origin: Origin | None = None
    failure_codes: Sequence[str] = ()
    lease_expires_before: datetime | None = None
    created_since: datetime | None = None
    updated_before: datetime | None = None
    workflow: str | None = None
    """The workflow's name (`workflow.name`)."""
    run_ids: Sequence[str] = ()
    """Only these runs: how the publisher looks up a batch of its launches in one read."""
    after_run_id: str | None = None
    newest_first: bool = False
    """Descending run ids (newest first, UUIDv7); `after_run_id` then pages toward older."""
    limit: int = 100


@dataclass(frozen=True, slots=True)
class EventDraft:
    """An event before the store gives it its `seq` (see `RunStore.create_run`)."""

    type: str
    data: dict[str, Any]
    attempt: int | None = None
    execution: str | None = None

    def stored(self, run_id: str, seq: int, at_ms: int) -> dict[str, Any]:
        """The event in storage form, without building the model: the same dict `encode` makes
        of `event(...)` (a test holds them equal)."""
        if not self.type:
            raise ValueError("an event needs a type")
        return {
            "run_id": run_id,
            "seq": seq,
            "type": self.type,
            "attempt": self.attempt,
            "execution": self.execution,
            "at": at_ms,
            "data": to_storage(self.data),
        }

    def event(self, run_id: str, seq: int, at: datetime) -> Event:
        return Event(
            run_id=run_id,
            seq=seq,
            type=self.type,
            attempt=self.attempt,
            execution=self.execution,
            at=at,
            data=self.data,
        )


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A listed run whose stored document does not validate (`DocumentInvalid`): named, so one
    bad row never hides every other run from a listing (an on-call walkthrough's finding)."""

    run_id: str
    error: str


@dataclass(frozen=True, slots=True)
class RunPage:
    runs: list[RunDocument]
    next_after: str | None
    """Pass as `after_run_id` for the next page; None on the last page."""
    unreadable: list[Unreadable] = field(default_factory=list)
    """Rows of this page that did not validate, left out of `runs` (they count for `limit`)."""


@dataclass(frozen=True, slots=True)
class RunCopy:
    """Where a run's copy on the work queue is, as its document records it: enough for the
    sweeper to pass over a run whose copy is still on the queue without reading the run
    (issue 19: a pass over a 50 000-run backlog reads 50 000 of these, not 50 000 documents)."""

    run_id: str
    attempt: int
    """The run's attempt (0: the store could not read it from a corrupt document)."""
    published_attempt: int | None
    """`publication.attempt` (None: no publication recorded)."""
    stream_seq: int | None
    """`publication.stream_seq` (None: no publication, or its sequence is not known yet)."""
    status: str | None = None
    """The run's status (None: the store could not read it)."""
    failure_code: str | None = None
    """The run's `failure_code`: the sweeper passes over a run parked for a person without
    reading it (found by review: every pass read each parked run in full)."""


@dataclass
class RunCopyPage:
    copies: list[RunCopy]
    next_after: str | None
    """Pass as `after_run_id` for the next page; None on the last page."""


@runtime_checkable
class RunStore(Protocol):
    async def create_run(
        self, doc: RunDocument, *, events: Sequence[EventDraft] = ()
    ) -> RunDocument:
        """Insert a new run. Create-only: an existing `run_id` raises `RunAlreadyExists` and
        leaves the existing document untouched. `events` (seq 1, 2, ...) ride with the insert:
        in its transaction on SQLite, right after it on MongoDB, never when it is refused. A
        launch's `run_launched` and `run_queued` cost no round trip of their own."""
        ...

    async def get_run(self, run_id: str) -> RunDocument:
        """The run as stored (not filtered by tenant). `RunNotFound` if absent;
        `DocumentInvalid` if the stored document does not validate."""
        ...

    async def update_run(
        self,
        run_id: str,
        conditions: Sequence[Condition],
        update: Update,
        *,
        events: Sequence[EventDraft] = (),
    ) -> RunDocument | CasConflict:
        """Compare-and-set: when every condition holds, apply `update` atomically and return
        the new document; otherwise return `CasConflict` with the current document. A status
        write must expect a status and be legal in the status table (`IllegalTransition`).

        `events` are the events the write describes (SPEC §6.3, issue 19 lever 1): appended,
        gap-free and in order, only when the write lands — in the same transaction on SQLite;
        on MongoDB the document write, then one `insert_many`. A refused write appends none."""
        ...

    async def list_runs(self, query: RunQuery) -> RunPage:
        """Runs matching `query`, ordered by `run_id`, at most `query.limit`."""
        ...

    async def list_run_copies(self, query: RunQuery) -> RunCopyPage:
        """What `list_runs` would page through, as `RunCopy` rows only (no document read or
        validated): the sweeper's first look at a backlog (SPEC §5.9)."""
        ...

    async def status_counts(self, tenant: str | None = None) -> dict[RunStatus, int]:
        """How many runs are in each status (statuses with none are absent): the live view."""
        ...

    async def delete_run(self, run_id: str) -> bool:
        """Remove a run with its events and interactions (`gc`). True if it existed."""
        ...

    async def append_event(
        self,
        run_id: str,
        type: str,
        data: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
        execution: str | None = None,
    ) -> Event:
        """Append one event with `seq = max(seq) + 1` for the run under a unique
        `(run_id, seq)` index, retrying on a conflict: sequences are gap-free per run."""
        ...

    async def read_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        """Events with `seq > after_seq`, ascending: readers poll "after the last seq"."""
        ...

    async def read_events_before(
        self, run_id: str, before_seq: int | None = None, limit: int = 1000
    ) -> list[Event]:
        """Events with `seq < before_seq` (from the newest when None), descending: a reader
        after a run's latest event of a kind stops at it instead of reading the history whole
        (`store.events.events_newest_first`)."""
        ...

    async def put_interaction(self, interaction: Interaction) -> Interaction:
        """Create the interaction, or return the existing one with that id (idempotent, so the
        action that projects it can be re-run)."""
        ...

    async def answer_interaction(
        self, interaction_id: str, answers: dict[str, Any], at: datetime
    ) -> Interaction | None:
        """Pending → answered by CAS; None if it was not pending (or does not exist)."""
        ...

    async def retire_interactions(self, run_id: str) -> int:
        """Pending → retired for every pending interaction of the run; returns how many."""
        ...

    async def list_interactions(
        self, run_id: str, *, pending_only: bool = False
    ) -> list[Interaction]: ...

    async def put_staged_upload(self, record: StagedUpload) -> None:
        """Create-only, like `create_run` (ids carry 128 bits of randomness)."""
        ...

    async def get_staged_upload(self, upload_id: str, tenant: str) -> StagedUpload | None:
        """The record if it exists *and* belongs to `tenant`; another tenant sees None."""
        ...

    async def delete_staged_upload(self, upload_id: str, tenant: str) -> bool: ...

    async def claim_staged_upload(self, upload_id: str, tenant: str, claimant: str) -> bool:
        """Set the record's `claimed_by` to `claimant` if it is unclaimed or already
        `claimant`'s, in one atomic write; False if the tenant has no such record or another
        claimant holds it. What makes "used once" hold for concurrent promotions."""
        ...

    async def release_staged_upload(self, upload_id: str, tenant: str, claimant: str) -> bool:
        """Clear `claimed_by` if `claimant` holds it (a promotion that failed leaves the upload
        usable for a retry); False otherwise."""
        ...

    async def list_staged_uploads_before(
        self, cutoff: datetime, limit: int = 100
    ) -> list[StagedUpload]:
        """Records created before `cutoff`, any tenant (for the reaper)."""
        ...

    async def try_lock(self, name: str, owner: str, now: datetime, ttl_s: float) -> bool:
        """Take or renew the named lock if it is free, expired, or already `owner`'s."""
        ...

    async def ping(self) -> None:
        """Raise `StoreUnavailable` unless the store answers (readiness)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BlobInfo:
    key: str
    size: int
    modified: datetime


@runtime_checkable
class BlobStore(Protocol):
    """Bytes by key (`runs/<id>/scratch/<token>.tgz`, `uploads/<id>/<name>`, `dlq/<seq>.bin`).
    Keys are relative, '/'-separated, never contain '..' (`BlobKeyInvalid`). Large objects move
    file-to-file, never whole in memory."""

    async def put_file(self, key: str, path: Path) -> BlobInfo:
        """Store the file's bytes under `key`, replacing any previous object atomically."""
        ...

    async def put_bytes(self, key: str, data: bytes) -> BlobInfo: ...

    async def create_bytes(self, key: str, data: bytes) -> BlobInfo | None:
        """Store `data` under `key` only if no object is there; None (and the object left as it
        was) when one is. Atomic: of racing creates one wins, and a reader sees no object or the
        whole one. For a key a checkpoint may reference, which nobody may overwrite (SPEC §2's
        spilled outputs: a fenced execution writes the same key as its adopter)."""
        ...

    async def get_to_file(self, key: str, path: Path) -> BlobInfo:
        """Write the object to `path` (streamed). `BlobNotFound` if absent."""
        ...

    async def get_bytes(self, key: str) -> bytes:
        """For small objects only (records, DLQ bodies)."""
        ...

    async def stat(self, key: str) -> BlobInfo | None: ...

    async def delete(self, key: str) -> bool: ...

    async def list(self, prefix: str) -> list[BlobInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""
        ...

    async def close(self) -> None: ...
