"""The API's request and response bodies (SPEC v2.2 §10c): the one source of both the
validation the routes do and the OpenAPI document (`openapi.py`), so neither can drift.

Responses are views of the operations' typed values, shaped like the CLI's `--json` output
(a run shows at least `run_id`, `status`, `failure_code`, `error`, `attempt`, `workflow`,
`created_at`, `updated_at`, SPEC §10). Requests forbid unknown fields: a misspelled `answer`
must be a 400, not a resume without answers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from publisher.dlq import DlqRecord
from runner.operations.retry_wait import RetryWait
from store import Budget, Event, RunDocument, RunStatus

MAX_SEQ = 2**53
"""Bound on an event seq or record id a caller gives: beyond any real one, within SQLite's
integer and JSON's exact numbers."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ---------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str = Field(description="stable snake_case code (the CLI's, SPEC §10)")
    message: str
    remedy: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """`/readyz`: whether this server can act now — NATS (JetStream) and the store answer."""

    ok: bool
    problems: list[str]


# -- runs -----------------------------------------------------------------------------------


class WorkflowOut(BaseModel):
    name: str
    source_hash: str


class Prompt(BaseModel):
    """What a `paused_waiting_human` run asks (its pending interaction)."""

    node: str | None
    message: str
    questions: list[dict[str, Any]]


class RunOut(BaseModel):
    run_id: str
    tenant: str
    status: RunStatus
    failure_code: str | None
    error: str | None
    attempt: int
    workflow: WorkflowOut
    origin: str
    created_at: datetime
    updated_at: datetime
    cause_code: str | None
    outputs: dict[str, Any]
    prompt: Prompt | None = Field(description="set while the run waits for answers")
    budget: dict[str, Any]
    cancel_requested: bool
    retry: dict[str, Any] | None = Field(
        default=None, description="the automatic retry a failed_resumable run waits for"
    )
    usage: dict[str, Any] | None = Field(
        default=None,
        description="what the run consumed (iterations, elapsed s, cost_usd): what a budget"
        " cap is checked against; null before its first checkpoint",
    )
    attachments: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the files the run holds: name, filename, bytes, sha256, key (SPEC §8)",
    )
    dlq_record: int | None = Field(
        default=None,
        description="the DLQ record a DLQ_PARKED run waits on: its way back is"
        " POST /dlq/replay with its id (set by GET /runs/{id} only)",
    )

    @classmethod
    def of(
        cls, doc: RunDocument, retry: RetryWait | None = None, dlq_record: int | None = None
    ) -> RunOut:
        cp = doc.checkpoint
        pending = cp.pending_interaction if cp else None
        prompt = None
        if pending and doc.status is RunStatus.PAUSED_WAITING_HUMAN:
            node = pending.get("node")
            prompt = Prompt(
                node=None if node is None else str(node),
                message=str(pending.get("message", "")),
                questions=list(pending.get("questions", [])),
            )
        return cls(
            run_id=doc.run_id,
            tenant=doc.tenant,
            status=doc.status,
            failure_code=doc.failure_code,
            error=doc.error,
            attempt=doc.attempt,
            workflow=WorkflowOut(name=doc.workflow.name, source_hash=doc.workflow.source_hash),
            origin=str(doc.origin),
            created_at=doc.created_at,
            updated_at=doc.updated_at,
            cause_code=doc.cause_code,
            outputs=cp.outputs if cp else {},
            prompt=prompt,
            budget=doc.budget.model_dump(mode="json"),
            cancel_requested=doc.cancel_requested,
            retry=retry.to_dict() if retry else None,
            usage=cp.usage.model_dump(mode="json") if cp else None,
            attachments=[a.model_dump(mode="json") for a in doc.attachments],
            dlq_record=dlq_record,
        )


class UnreadableOut(BaseModel):
    run_id: str
    error: str = Field(description="why its stored document does not validate")


class RunPage(BaseModel):
    runs: list[RunOut]
    next_after: str | None = Field(description="pass as `after` for the next page")
    unreadable: list[UnreadableOut] = Field(
        default_factory=list,
        description="runs of this page whose stored document does not validate, left out",
    )


class LaunchRequest(_Request):
    workflow: str = Field(min_length=1, description="the workflow file's YAML source")
    filename: str = Field(
        default="workflow.yaml", min_length=1, max_length=255, description="named in errors"
    )
    vars: dict[str, Any] = Field(default_factory=dict, description="the workflow's vars")
    attachments: dict[str, str] = Field(
        default_factory=dict,
        max_length=1000,
        description="attachment name → upload id (POST /api/v1/uploads)",
    )


class BudgetRequest(_Request):
    max_duration_s: float | None = Field(default=None, gt=0, le=10**9)
    max_cost_usd: float | None = Field(default=None, ge=0, le=10**12)
    max_iterations: int | None = Field(default=None, ge=1, le=10**9)

    def to_budget(self) -> Budget | None:
        if (
            self.max_duration_s is None
            and self.max_cost_usd is None
            and self.max_iterations is None
        ):
            return None
        return Budget(
            max_duration=self.max_duration_s,
            max_cost_usd=self.max_cost_usd,
            max_iterations=self.max_iterations,
        )


class ResumeRequestBody(_Request):
    answers: dict[str, Any] = Field(
        default_factory=dict, description="typed answers to the pending questions"
    )
    force: bool = Field(default=False, description="accept a changed workflow source")
    accept_scratch_loss: bool = Field(default=False, description="continue without the scratch")
    budget: BudgetRequest | None = Field(default=None, description="raised caps")
    workflow: str | None = Field(
        default=None, min_length=1, description="a new workflow source (with force if it differs)"
    )


class RewindRequest(_Request):
    node: str = Field(min_length=1, max_length=256)
    workflow: str | None = Field(default=None, min_length=1, description="a new workflow source")


class RewindResponse(BaseModel):
    run: RunOut
    dropped_nodes: list[str]


# -- events ---------------------------------------------------------------------------------


class EventOut(BaseModel):
    run_id: str
    seq: int
    type: str
    attempt: int | None
    execution: str | None
    at: datetime
    data: dict[str, Any]

    @classmethod
    def of(cls, event: Event) -> EventOut:
        return cls.model_validate(event.model_dump())


class EventPage(BaseModel):
    events: list[EventOut]
    next_after: int | None = Field(description="pass as `after` for the next page")


class TimelineItem(BaseModel):
    """An event (`source: event`, an `EventOut`'s fields) or a delivery-log entry
    (`source: delivery`: delivery number, action, reason, delay, DLQ record, runner)."""

    model_config = ConfigDict(extra="allow")

    source: Literal["event", "delivery"]
    at: datetime


class Timeline(BaseModel):
    entries: list[TimelineItem]


# -- dead letters ---------------------------------------------------------------------------


class DlqRecordOut(BaseModel):
    id: int
    run_id: str | None
    attempt: int | None
    reason: str
    detail: str
    num_delivered: int
    runner: str
    at: datetime
    replayable: bool
    body_bytes: int
    headers: dict[str, str]

    @classmethod
    def of(cls, record: DlqRecord) -> DlqRecordOut:
        return cls.model_validate(record.model_dump(exclude={"body_b64", "body_key"}))


class DlqList(BaseModel):
    records: list[DlqRecordOut]
    next_after: int | None = Field(
        default=None, description="pass as `after` for the next page; null on the last"
    )


class DlqDetail(BaseModel):
    record: DlqRecordOut
    body_b64: str
    message: dict[str, Any] | None = Field(description="the decoded run message, when it decodes")
    undecodable: str | None = Field(description="why the body does not decode, when it does not")
    run: RunOut | None
    replay_refusal: ErrorDetail | None = Field(
        default=None,
        description="why a replay would be refused now (`stale_record`, `record_not_replayable`)",
    )


class DlqSelection(_Request):
    """The records to act on: `ids`, or `all` (narrowed by `reason`, and for a purge by
    `older_than`, a duration such as `7d`)."""

    ids: list[Annotated[int, Field(ge=1, le=MAX_SEQ)]] | None = Field(
        default=None, min_length=1, max_length=1000
    )
    all: bool = False
    reason: str | None = Field(default=None, min_length=1, max_length=200)
    older_than: str | None = Field(default=None, min_length=1, max_length=40)


class ReplayOutcomeOut(BaseModel):
    id: int
    run: RunOut | None = None
    error: ErrorDetail | None = None


class ReplayResponse(BaseModel):
    outcomes: list[ReplayOutcomeOut]
    not_attempted: list[int] = Field(description="records left when NATS or the store went away")
    stopped_by: ErrorDetail | None = None


class PurgeResponse(BaseModel):
    purged: list[int]


# -- uploads --------------------------------------------------------------------------------


class UploadFileOut(BaseModel):
    filename: str
    bytes: int
    sha256: str


class UploadOut(BaseModel):
    upload_id: str = Field(description="attach it to a launch: attachments: {name: upload_id}")
    files: list[UploadFileOut]
