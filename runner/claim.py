"""The claim (SPEC §5.3) and the writes admission makes instead of one (steps 6 and 7).

Every claim is one CAS on the status, attempt and `version` read at admission (the version
carries `scratch`, `budget` and `workflow.source_hash` as judged), with the lease free. It writes
a new lease stamped with the delivery's stream sequence, points `publication.stream_seq` at that
delivery, and clears `failure_code` / `error`. Only the fresh claim writes a resume's effects,
and only for the attempt that carried them (SPEC §5.7).

The publication is written as one whole object, never as `publication.<field>` paths: a fresh
claim can beat the publisher's own `publication` write, and then the parent is still null, where
`mongod` refuses a dotted `$set` (and the store refuses it on every backend, `UnwritablePath`).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from engine import attachments
from engine.failures import FailureCode
from engine.resume import claim_effects
from runner.admission import ClaimPath, DeliveryInfo
from store import (
    BlobStore,
    CasConflict,
    Eq,
    Lease,
    LeaseFree,
    Publication,
    RunDocument,
    RunStatus,
    RunStore,
    Update,
)
from store.errors import StoreCorrupt
from store.staging import StagedUploadInvalid, StagingStore


def _read_conditions(run: RunDocument, now: datetime, skew: timedelta) -> list[Any]:
    return [
        Eq("status", run.status),
        Eq("attempt", run.attempt),
        Eq("version", run.version),
        LeaseFree(now, skew),
    ]


def _publication(run: RunDocument, delivery: DeliveryInfo, now: datetime) -> Publication:
    """The claimed delivery as the copy that carries the run. The delivery's message id is not
    known here, so a recorded `msg_id` is kept only when it names this very copy."""
    pub, msg_id = run.publication, None
    if pub is not None and (pub.attempt, pub.stream_seq) == (run.attempt, delivery.stream_seq):
        msg_id = pub.msg_id
    return Publication(attempt=run.attempt, stream_seq=delivery.stream_seq, at=now, msg_id=msg_id)


async def claim(
    store: RunStore,
    run: RunDocument,
    path: ClaimPath,
    delivery: DeliveryInfo,
    *,
    owner: str,
    now: datetime,
    ttl: timedelta,
    skew: timedelta,
    blobs: BlobStore | None = None,
) -> RunDocument | CasConflict:
    """`blobs`: where a resume's uploaded `file` answers are promoted to the run before the
    CAS (SPEC §6.4, §8); the CAS then records them as attachments."""
    token = uuid.uuid4().hex
    fields: dict[str, Any] = {
        "status": RunStatus.RUNNING,
        "lease": Lease(
            owner=owner,
            token=token,
            attempt=run.attempt,
            stream_seq=delivery.stream_seq,
            expires_at=now + ttl,
        ).model_dump(),
        "publication": _publication(run, delivery, now).model_dump(),
        "failure_code": None,
        "error": None,
        "cause_code": None,
    }
    spec = run.resume_spec
    if path == "fresh" and spec is not None and spec.attempt == run.attempt:
        if blobs is not None and attachments.uploaded_answers(run, spec):
            try:
                await attachments.promote_answers(StagingStore(store, blobs), blobs, run, spec)
            except StoreCorrupt as exc:
                # The staged bytes are not the ones the resume staged: no retry brings them
                # back, so the answer is refused like a gone upload (SPEC §8), never nak'd.
                raise StagedUploadInvalid(f"the answer cannot be used: {exc.message}") from exc
        fields.update(claim_effects(run, spec))
        fields.update(attachments.answer_attachments(run, spec))
    return await store.update_run(run.run_id, _read_conditions(run, now, skew), Update(set=fields))


async def cancel_stale(
    store: RunStore, run: RunDocument, *, now: datetime, skew: timedelta
) -> RunDocument | CasConflict:
    """Step 6: only a stale flag reaches here (no execution holds the lease)."""
    return await store.update_run(
        run.run_id,
        _read_conditions(run, now, skew),
        Update(set={"status": RunStatus.CANCELLED, "cancel_requested": False}, unset=["lease"]),
    )


async def refuse_answer(
    store: RunStore, run: RunDocument, detail: str, *, now: datetime, skew: timedelta
) -> RunDocument | CasConflict:
    """A resume's uploaded `file` answer that cannot be promoted (its staged upload is gone):
    `queued → prior_status` on the fresh path, as a scratch refusal there is (SPEC §5.2 step 7),
    with `ATTACHMENTS_UNFETCHABLE` (§8: the answer's bytes cannot be fetched) and the cause.
    None of the resume's effects is written, so the run waits at the same question, resumable
    with a new answer; never an internal error, never a DLQ record."""
    assert run.resume_spec is not None
    return await store.update_run(
        run.run_id,
        _read_conditions(run, now, skew),
        Update(
            set={
                "status": run.resume_spec.prior_status,
                "failure_code": FailureCode.ATTACHMENTS_UNFETCHABLE,
                "error": detail,
            }
        ),
    )


async def park_refusal(
    store: RunStore,
    run: RunDocument,
    kind: str,
    path: ClaimPath,
    detail: str,
    *,
    now: datetime,
    skew: timedelta,
) -> RunDocument | CasConflict:
    """Step 7: a scratch refusal on the fresh path puts the run back where the resume found it;
    on adoption or auto-retry it parks `failed_resumable SCRATCH_NOT_PORTABLE`; a budget
    refusal always parks `paused_operator BUDGET_EXCEEDED`."""
    if kind == "budget":
        status, code = RunStatus.PAUSED_OPERATOR, FailureCode.BUDGET_EXCEEDED
    elif path == "fresh" and run.resume_spec is not None:
        status, code = run.resume_spec.prior_status, FailureCode.SCRATCH_NOT_PORTABLE
    else:
        status, code = RunStatus.FAILED_RESUMABLE, FailureCode.SCRATCH_NOT_PORTABLE
    return await store.update_run(
        run.run_id,
        _read_conditions(run, now, skew),
        Update(set={"status": status, "failure_code": code, "error": detail}),
    )
