"""The wire contract (SPEC §3): names, the versioned message, headers, and decoding.

The body is informational beyond `run_id`, `tenant` and `attempt`: the claim applies the run
document's `resume_spec`, never the message's copy of it (so a stale or forged copy cannot lend
consents, SPEC §5.7). `Nats-Msg-Id` is `<run_id>:<attempt>`: a retried publish of one attempt
dedupes, a new attempt never does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from publisher.errors import MalformedMessage, UnsupportedSchema
from store import Budget, Consents, ResumeSpec, UtcDatetime

SCHEMA_VERSION = 1

MessageKind = Literal["launch", "resume", "replay", "handoff", "sweep"]

HDR_MSG_ID = "Nats-Msg-Id"
HDR_ATTEMPT = "Runfleet-Attempt"
HDR_SCHEMA = "Runfleet-Schema"
HDR_TRACEPARENT = "traceparent"


@dataclass(frozen=True, slots=True)
class WireNames:
    """Stream, subject and consumer names. `namespace` isolates tests (and, if ever needed,
    fleets sharing one NATS account); production uses the SPEC §3 names (empty namespace)."""

    namespace: str = ""

    def _n(self, base: str) -> str:
        return f"{self.namespace}_{base}" if self.namespace else base

    def _s(self, base: str) -> str:
        return f"{self.namespace.lower()}.{base}" if self.namespace else base

    @property
    def runs_stream(self) -> str:
        return self._n("RUNFLEET_RUNS")

    @property
    def runs_subject(self) -> str:
        return self._s("runfleet.runs")

    @property
    def consumer(self) -> str:
        return self._n("runfleet-runners")

    @property
    def advisory_stream(self) -> str:
        return self._n("RUNFLEET_ADVISORIES")

    @property
    def advisory_subject(self) -> str:
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.runs_stream}.{self.consumer}"

    @property
    def backstop_consumer(self) -> str:
        return self._n("runfleet-backstop")

    @property
    def dlq_stream(self) -> str:
        return self._n("RUNFLEET_DLQ")

    def dlq_subject(self, seq: int | str) -> str:
        return self._s(f"runfleet.dlq.{seq}")

    def control_subject(self, run_id: str) -> str:
        return self._s(f"runfleet.control.{run_id}")

    @property
    def delivery_stream(self) -> str:
        return self._n("RUNFLEET_DELIVERIES")

    def delivery_subject(self, run_id: str) -> str:
        """`runfleet.deliveries.<run_id>` (SPEC v2.2 §10b); `*` for the stream's subjects."""
        return self._s(f"runfleet.deliveries.{run_id}")


class ResumeCopy(BaseModel):
    """A copy of the resume's request, for logs only: the claim reads `resume_spec`."""

    model_config = ConfigDict(extra="forbid")

    answers: dict[str, Any] = Field(default_factory=dict)
    consents: Consents = Field(default_factory=Consents)
    budget: Budget | None = None
    source_hash: str | None = None

    @classmethod
    def of(cls, spec: ResumeSpec) -> ResumeCopy:
        """The copy of what a resume's CAS wrote (`resume_spec`): the resume and a replay
        that finishes an interrupted one publish the same."""
        return cls(
            answers=spec.answers,
            consents=spec.consents,
            budget=spec.budget,
            source_hash=spec.workflow.source_hash if spec.workflow else None,
        )


class RunMessage(BaseModel):
    """The body of a publication (schema `v` 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    run_id: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    attempt: int = Field(ge=1, strict=True)
    kind: MessageKind
    published_at: UtcDatetime
    resume: ResumeCopy | None = None

    @field_validator("v", mode="before")
    @classmethod
    def _v_is_a_number(cls, value: Any) -> Any:
        """JSON `true` is not schema 1 (lax validation took it for 1: an on-call walkthrough
        saw a `{"v": true}` body acked as `settled`); `attempt` is strict for the same reason."""
        if isinstance(value, bool):
            raise ValueError("v must be the number 1")
        return value


def msg_id(run_id: str, attempt: int, sweep: int | None = None) -> str:
    base = f"{run_id}:{attempt}"
    return base if sweep is None else f"{base}:s{sweep}"


def encode(
    message: RunMessage, *, traceparent: str | None = None, sweep: int | None = None
) -> tuple[bytes, dict[str, str]]:
    headers = {
        HDR_MSG_ID: msg_id(message.run_id, message.attempt, sweep),
        HDR_ATTEMPT: str(message.attempt),
        HDR_SCHEMA: str(SCHEMA_VERSION),
    }
    if traceparent:
        headers[HDR_TRACEPARENT] = traceparent
    return message.model_dump_json().encode(), headers


def decode(data: bytes, headers: dict[str, str] | None = None) -> RunMessage:
    """Decode a body: `UnsupportedSchema` for a newer `v` (a rolling upgrade: nak and wait),
    `MalformedMessage` for anything else that does not parse or validate (dead-lettered).

    Whatever the parser or validator raises is `MalformedMessage` (SPEC v2.2 §5.2 step 1): a
    5 000-digit integer raises `ValueError` (Python's int-string limit), 200 000 nested arrays
    raise `RecursionError`, and neither may escape as an unexpected error — that would take the
    transient ladder instead of the DLQ, and in the backstop stop a loop (§13.12)."""
    try:
        raw = json.loads(data)
    except ValueError as exc:
        if "int_max_str_digits" in str(exc) or "Exceeds the limit" in str(exc):
            # JSON after all: Python's int-string limit, whose message advises a Python call.
            raise MalformedMessage("body holds an integer of more than 4 300 digits") from None
        raise MalformedMessage(f"body is not JSON: {_describe(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - any parse failure: UTF-8, JSON, int limit, depth
        raise MalformedMessage(f"body is not JSON: {_describe(exc)}") from None
    if not isinstance(raw, dict):
        raise MalformedMessage(f"body is JSON {type(raw).__name__}, not an object")
    version = raw.get("v")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise UnsupportedSchema(f"schema v{str(version)[:20]} is newer than v{SCHEMA_VERSION}")
    try:
        message = RunMessage.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise MalformedMessage(f"invalid message at {where[:200]}: {first['msg'][:200]}") from None
    except Exception as exc:  # noqa: BLE001 - a validator failing on a hostile value
        raise MalformedMessage(f"invalid message: {_describe(exc)}") from None
    attempt_hdr = (headers or {}).get(HDR_ATTEMPT)
    if attempt_hdr is not None and attempt_hdr != str(message.attempt):
        raise MalformedMessage(
            f"header {HDR_ATTEMPT}={attempt_hdr[:40]} disagrees with body attempt"
            f" {str(message.attempt)[:40]}"
        )
    return message


def _describe(exc: BaseException) -> str:
    """A short, bounded description: a hostile body must not make a multi-megabyte DLQ detail."""
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}{'…' if len(text) > 200 else ''}"
