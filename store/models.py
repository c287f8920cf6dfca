"""Stored types: the run document (SPEC §2) and the records projected from it (§6.3, §8).

Pydantic models, because these cross the storage boundary and must validate on read: a document
that does not validate is a typed `DocumentInvalid`, never silently rewritten. Unknown fields are
refused (`extra="forbid"`) so a misspelt field path in a compare-and-set cannot write garbage.

The engine owns the *meaning* of `checkpoint`, `budget` and `failure_code`; the store only keeps
their shape, so `failure_code` is a plain string here (the engine's enum is its vocabulary).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from store.timeutil import UtcDatetime

NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED_WAITING_HUMAN = "paused_waiting_human"
    PAUSED_OPERATOR = "paused_operator"
    FAILED_RESUMABLE = "failed_resumable"
    CANCELLED = "cancelled"
    FINISHED = "finished"
    FAILED = "failed"


class Origin(StrEnum):
    FLEET = "fleet"
    LOCAL = "local"


class _Stored(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class WorkflowRef(_Stored):
    """The workflow a run executes: its whole source text travels with the run."""

    name: NonEmptyStr
    source: str
    source_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Budget(_Stored):
    """Effective caps. `None` means uncapped. Durations are seconds."""

    max_duration: float | None = None
    max_iterations: int | None = None
    max_cost_usd: float | None = None


class Consents(_Stored):
    """A resume's own consents (SPEC §5.7): applied only by the fresh claim of its attempt."""

    force: bool = False
    accept_scratch_loss: bool = False


class ResumeSpec(_Stored):
    """The request of one attempt, stamped with it; the fresh claim writes its effects."""

    attempt: int = Field(ge=1)
    prior_status: RunStatus
    answers: dict[str, Any] = Field(default_factory=dict)
    consents: Consents = Field(default_factory=Consents)
    budget: Budget | None = None
    workflow: WorkflowRef | None = None
    published_at: UtcDatetime | None = None
    kind: Literal["resume", "replay", "local"] = "resume"
    dlq_record: int | None = None
    """For a replay: the DLQ record it replays, so a re-run of a bulk replay that died
    between this write and the record's removal can finish the job (and never replay twice)."""


class Publication(_Stored):
    """The queue copy that carries the run (set after a PubAck, and again by every claim)."""

    attempt: int = Field(ge=1)
    stream_seq: int | None = None
    at: UtcDatetime
    msg_id: str | None = None


class Lease(_Stored):
    """An execution's time-bound right to write the run (SPEC §5.4)."""

    owner: NonEmptyStr
    token: NonEmptyStr
    attempt: int = Field(ge=1)
    stream_seq: int | None = None
    expires_at: UtcDatetime


class BudgetUsage(_Stored):
    """Budget accounting: never decreases across resumes (SPEC §13.7)."""

    elapsed: float = 0.0
    iterations: int = 0
    cost_usd: float = 0.0


class Checkpoint(_Stored):
    """The authoritative execution state after a node boundary (SPEC §6.2)."""

    restart_node: str | None = None
    outputs: dict[str, Any] = Field(default_factory=dict)
    loop_counters: dict[str, int] = Field(default_factory=dict)
    pending_interaction: dict[str, Any] | None = None
    usage: BudgetUsage = Field(default_factory=BudgetUsage)
    vars: dict[str, Any] = Field(default_factory=dict)
    node_retries: dict[str, int] = Field(default_factory=dict)
    progress: int = 0
    completed: list[str] = Field(default_factory=list)
    sandbox_progress: int = 0
    sandbox_done: dict[str, int] = Field(default_factory=dict)
    """Sandbox node (`SANDBOX_KINDS`) → the progress counter its last finish wrote: what a
    rewind's dropped nodes are taken out of when a bank's staleness is judged (SPEC §7.4)."""


class ScratchRecord(_Stored):
    """The fenced bank record (SPEC §7.3): names the one key a restore may read."""

    state: Literal["banked", "empty", "unbankable", "unknown"]
    key: str | None = None
    bytes: int = 0
    progress: int = 0
    raced: list[str] = Field(default_factory=list)
    unquiesced: bool = False
    forsaken: bool = False
    lease_token: str | None = None
    at: UtcDatetime | None = None


class StagedFile(_Stored):
    """One file of a staged upload, or one attachment a run holds (`key` says which)."""

    name: NonEmptyStr
    filename: NonEmptyStr
    bytes: int = Field(ge=0)
    sha256: str
    key: NonEmptyStr


class RunDocument(_Stored):
    """The run: the authority for everything a claim decides (SPEC §2)."""

    run_id: NonEmptyStr
    tenant: NonEmptyStr = "default"
    origin: Origin = Origin.FLEET
    workflow: WorkflowRef
    inputs: dict[str, Any] = Field(default_factory=dict)
    budget: Budget = Field(default_factory=Budget)
    status: RunStatus
    failure_code: str | None = None
    cause_code: str | None = None
    error: str | None = None
    attempt: int = Field(default=1, ge=1)
    attempt_at: UtcDatetime
    publication: Publication | None = None
    resume_spec: ResumeSpec | None = None
    lease: Lease | None = None
    checkpoint: Checkpoint | None = None
    cancel_requested: bool = False
    scratch: ScratchRecord | None = None
    attachments: list[StagedFile] = Field(default_factory=list)
    """The files the run holds (SPEC §8): promoted before the document was created, or by the
    claim that recorded a `file` answer (§6.4); each `key` is under `runs/<id>/attachments/`."""
    metrics: dict[str, Any] = Field(default_factory=dict)
    sweep_republishes: int = 0
    created_at: UtcDatetime
    updated_at: UtcDatetime
    version: int = Field(default=1, ge=1)


class Event(_Stored):
    """One event (SPEC §6.3). `seq` is gap-free per run, starting at 1."""

    run_id: NonEmptyStr
    seq: int = Field(ge=1)
    type: NonEmptyStr
    attempt: int | None = None
    execution: str | None = None
    at: UtcDatetime
    data: dict[str, Any] = Field(default_factory=dict)


class InteractionStatus(StrEnum):
    PENDING = "pending"
    ANSWERED = "answered"
    RETIRED = "retired"


class Interaction(_Stored):
    """A question put to a person; a projection of the checkpoint's pending interaction."""

    id: NonEmptyStr
    run_id: NonEmptyStr
    tenant: NonEmptyStr = "default"
    node: NonEmptyStr
    attempt: int = Field(ge=1)
    questions: list[dict[str, Any]] = Field(default_factory=list)
    status: InteractionStatus = InteractionStatus.PENDING
    answers: dict[str, Any] | None = None
    created_at: UtcDatetime
    answered_at: UtcDatetime | None = None


class StagedUpload(_Stored):
    """A staged upload record (SPEC §8); its bytes live in the blob store under `key`s."""

    id: NonEmptyStr
    tenant: NonEmptyStr
    files: list[StagedFile] = Field(default_factory=list)
    created_at: UtcDatetime
    claimed_by: str | None = None
    """The run a promotion in progress copies this upload to (`claim_staged_upload`): a staged
    upload is used once (SPEC §8), by whichever of two concurrent launches claims it first."""


class LockRecord(_Stored):
    """A named, time-bound lock (the sweeper's one-pass-at-a-time lease, SPEC §5.9)."""

    name: NonEmptyStr
    owner: NonEmptyStr
    expires_at: UtcDatetime
