"""Attachments coming in (SPEC §8, §6.4): names and limits checked before any byte moves,
a launch's files promoted to its run before the run document exists, and a resume's uploaded
`file` answers promoted by the fresh claim. `engine.attachments` re-exports all of it; the
delivery side (materialise, seed, templates) lives there.
"""

from __future__ import annotations

import contextlib
import logging
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import BlobStore, ResumeSpec, RunDocument
from store.checked import fetch_checked
from store.errors import Refusal, RunfleetError, StoreError
from store.models import StagedFile, StagedUpload
from store.staging import (
    StagedUploadInUse,
    StagedUploadInvalid,
    StagedUploadNotFound,
    StagingStore,
)

NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
log = logging.getLogger(__name__)


class AttachmentNameInvalid(Refusal, code="attachment_name_invalid"):
    remedy = "name attachments with a lower-case letter, then letters, digits or '_' (≤ 64)"


class AttachmentTooLarge(Refusal, code="attachment_too_large"):
    remedy = "attach a smaller file, or raise RUNFLEET_ATTACHMENT_MAX_BYTES"


class TooManyAttachments(Refusal, code="too_many_attachments"):
    remedy = (
        "attach fewer files (bundle them in one archive), or raise RUNFLEET_ATTACHMENTS_MAX_COUNT"
    )


class LaunchFailed(RunfleetError, code="launch_failed"):
    """The launch's attachments could not be promoted to the run: no run was created and
    nothing was queued (SPEC §8)."""

    remedy = "check the blob store and the upload ids, then launch again"


@dataclass(frozen=True, slots=True)
class AttachmentLimits:
    max_bytes: int = 50 * 1024 * 1024
    """`RUNFLEET_ATTACHMENT_MAX_BYTES`: one file."""
    max_count: int = 32
    """`RUNFLEET_ATTACHMENTS_MAX_COUNT`: one run."""


# -- staging and promotion (the launch) ---------------------------------------------------------


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise AttachmentNameInvalid(f"attachment name {name!r} must match {NAME.pattern}")


def check_files(files: Mapping[str, Path], limits: AttachmentLimits, *, already: int = 0) -> None:
    """Names, the per-run count and the per-file size, before any byte moves."""
    for name in files:
        check_name(name)
    if already + len(files) > limits.max_count:
        raise TooManyAttachments(
            f"{already + len(files)} attachments exceed RUNFLEET_ATTACHMENTS_MAX_COUNT "
            f"({limits.max_count})"
        )
    for name, path in files.items():
        try:
            st = Path(path).stat()
        except OSError as exc:
            raise AttachmentNameInvalid(f"attachment {name!r}: cannot read {path}: {exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            # A device or a FIFO has no size to check and no end to read: `upload /dev/zero`
            # hung for good (found by a review).
            raise StagedUploadInvalid(
                f"attachment {name!r}: {path} is not a regular file (a directory, a device or a"
                " FIFO)",
                remedy="attach a regular file (copy the data to one first)",
            )
        size = st.st_size
        if size > limits.max_bytes:
            raise AttachmentTooLarge(
                f"attachment {name!r} ({path}) has {size} bytes, over "
                f"RUNFLEET_ATTACHMENT_MAX_BYTES ({limits.max_bytes})"
            )


async def stage(
    staging: StagingStore, tenant: str, files: Mapping[str, Path], limits: AttachmentLimits
) -> StagedUpload:
    """Stage `files` (name → path) after `check_files`: a refusal stores nothing."""
    check_files(files, limits)
    return await staging.stage(tenant, files)


async def promote_for_launch(
    staging: StagingStore,
    blobs: BlobStore,
    tenant: str,
    run_id: str,
    *,
    paths: Mapping[str, Path],
    uploads: Mapping[str, str],
    limits: AttachmentLimits,
) -> list[StagedFile]:
    """Stage `paths`, then promote them and each `uploads` (name → upload id) to `run_id`.

    A refusal (name, count, size, an upload id the tenant has no upload by:
    `StagedUploadNotFound`) is raised as it is, before any byte moves; so is an upload another
    launch is attaching (`StagedUploadInUse`, after this call's copies are removed). Any other
    failure removes what was promoted, discards what this call staged (a given upload id stays,
    for a retry) and raises `LaunchFailed`: the caller has not created the run yet, so nothing is
    queued."""
    for name in uploads:
        check_name(name)
    duplicate = set(paths) & set(uploads)
    if duplicate:
        raise AttachmentNameInvalid(f"attachment {sorted(duplicate)[0]!r} is given twice")
    check_files(paths, limits, already=len(uploads))
    for name, upload_id in uploads.items():
        record = await staging.get(upload_id, tenant)
        too_big = [f for f in record.files if f.bytes > limits.max_bytes]
        if too_big:  # an upload staged under a higher limit: refused before any byte moves
            raise AttachmentTooLarge(
                f"attachment {name!r} (upload {upload_id}) has {too_big[0].bytes} bytes, over "
                f"RUNFLEET_ATTACHMENT_MAX_BYTES ({limits.max_bytes})"
            )
    promoted: list[StagedFile] = []
    staged: StagedUpload | None = None
    try:
        for name, path in paths.items():
            # One upload per file: an upload holds its files by file name, so two paths with
            # the same name (`a=x/data.csv`, `b=y/data.csv`) could not share one.
            staged = await staging.stage(tenant, {name: path})
            promoted += await staging.promote(staged.id, tenant, run_id)
            staged = None  # promote discarded it
        for name, upload_id in uploads.items():
            # Discarded only once every attachment landed: a failure part-way must not use
            # up the ids the caller gave (found by a walkthrough: the retry its remedy named
            # met `upload_not_found`).
            promoted += await staging.promote(upload_id, tenant, run_id, rename=name, discard=False)
    except RunfleetError as exc:
        for done in promoted:
            with contextlib.suppress(StoreError):
                await blobs.delete(done.key)
        if staged is not None:
            with contextlib.suppress(StoreError):
                await staging.discard(staged.id, tenant)
        for upload_id in uploads.values():  # the ids given stay usable for the retry
            await staging.release(upload_id, tenant, run_id)
        if isinstance(exc, StagedUploadInUse):  # another launch took it (SPEC §8: used once)
            raise
        raise LaunchFailed(f"attachments of the launch could not be promoted: {exc}") from exc
    for upload_id in uploads.values():
        try:
            await staging.discard(upload_id, tenant)
        except StoreError as exc:  # the run has its attachments; the leftover is reaped later
            log.warning("launched, but staged upload %s was not discarded: %s", upload_id, exc)
    return promoted


# -- file answers through the queue (SPEC §6.4) --------------------------------------------------


def uploaded_answers(run: RunDocument, spec: ResumeSpec | None) -> dict[str, dict[str, Any]]:
    """The `file` answers of the resume of this attempt that name a staged upload
    (field → `{upload, filename, bytes, sha256}`): what the fresh claim turns into attachments."""
    if spec is None or spec.attempt != run.attempt:
        return {}
    return {
        name: value
        for name, value in spec.answers.items()
        if isinstance(value, dict) and isinstance(value.get("upload"), str)
    }


async def promote_answers(
    staging: StagingStore, blobs: BlobStore, run: RunDocument, spec: ResumeSpec | None
) -> None:
    """Before the fresh claim's CAS: each uploaded answer's bytes promoted to the run under the
    field's name, from the run's own tenant (another tenant's upload id is not found). A retry
    after a lost CAS finds the upload gone and this answer's bytes in place, which is done.

    An answer whose upload is gone before it was promoted (reaped past `RUNFLEET_UPLOAD_TTL`,
    discarded, its bytes lost) or cannot be promoted as a one-file answer is refused:
    `StagedUploadNotFound` / `StagedUploadInvalid` naming the field, which the runner turns
    into the run put back where the resume found it, waiting for a new answer (SPEC §6.4, §8;
    `runner.delivery`). Bytes under the field's key from an earlier answer of the same field
    are not this answer's: checked against its digest, never taken for it."""
    for name, answer in uploaded_answers(run, spec).items():
        key = f"runs/{run.run_id}/attachments/{name}"
        upload_id = answer["upload"]
        try:
            await staging.promote(upload_id, run.tenant, run.run_id, rename=name)
        except StagedUploadInUse as exc:
            raise StagedUploadNotFound(
                f"the upload {upload_id!r} answering {name!r} is taken ({exc.message}); "
                "resume the run again with a new answer"
            ) from exc
        except StagedUploadNotFound as exc:
            if await _promoted_already(blobs, key, answer):
                continue
            raise StagedUploadNotFound(
                f"the upload {upload_id!r} answering {name!r} is gone ({exc.message}); "
                "resume the run again with a new answer"
            ) from exc
        except StagedUploadInvalid as exc:
            raise StagedUploadInvalid(
                f"the upload {upload_id!r} answering {name!r} cannot be used: {exc.message}"
            ) from exc


async def _promoted_already(blobs: BlobStore, key: str, answer: Mapping[str, Any]) -> bool:
    """Whether `key` holds this answer's bytes (a retry after a lost CAS promoted them)."""
    info = await blobs.stat(key)
    if info is None or info.size != answer.get("bytes"):
        return False
    with tempfile.TemporaryDirectory(prefix="runfleet-answer-") as tmp:
        try:
            await fetch_checked(
                blobs,
                key,
                Path(tmp) / "answer",
                sha256=str(answer.get("sha256")),
                size=info.size,
                what="a promoted answer",
            )
        except StoreError:
            return False
    return True


def answer_attachments(run: RunDocument, spec: ResumeSpec | None) -> dict[str, Any]:
    """The fields the fresh claim writes for uploaded answers: the run's `attachments` with one
    per answered field (a field answered again replaces its attachment)."""
    answered = uploaded_answers(run, spec)
    if not answered:
        return {}
    held = [a for a in run.attachments if a.name not in answered]
    for name, answer in answered.items():
        held.append(
            StagedFile(
                name=name,
                filename=answer["filename"],
                bytes=answer["bytes"],
                sha256=answer["sha256"],
                key=f"runs/{run.run_id}/attachments/{name}",
            )
        )
    return {"attachments": [a.model_dump() for a in held]}
