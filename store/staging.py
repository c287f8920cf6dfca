"""Staged uploads: files an operator gives a run before the run exists (SPEC §8).

`stage` puts each file's bytes under `uploads/<id>/<filename>` in the blob store, then writes
the record (`RunStore.put_staged_upload`); the id is 128 random bits. Every read is scoped by
tenant: another tenant's upload is indistinguishable from a missing one.

Order matters for crash safety. Bytes are written before the record and deleted before it, so a
crash can leave a record whose bytes are (partly) gone, which `reap` and `discard` clean up, but
never bytes that no record points at (except when `stage` itself dies between a put and its
best-effort cleanup).

`promote` first claims the upload for its run (one atomic write on the record: of two launches
naming one upload at once, one gets it and the other is refused `upload_in_use`), copies the
bytes to `runs/<run_id>/attachments/<name>` (checking each file's sha256 on the way) and then
discards the upload; a failed promotion removes what it copied and releases the claim, so the
launch can be retried. A claim left by a process that died mid-promotion holds the upload until
it is reaped (`RUNFLEET_UPLOAD_TTL`); a retry for the same run id takes it back (ADR-0021).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path

from store.blobkeys import validate_segment
from store.checked import fetch_checked, sha256_file
from store.errors import BlobKeyInvalid, BlobNotFound, Refusal, StoreError
from store.models import StagedFile, StagedUpload
from store.protocols import BlobStore, RunStore
from store.timeutil import utcnow

log = logging.getLogger(__name__)

_REAP_BATCH = 100


class StagedUploadNotFound(Refusal, code="upload_not_found"):
    """No staged upload with that id for this tenant (never staged, discarded, promoted, reaped,
    or staged by another tenant: the error does not say which). A refusal of what the caller
    named: the CLI's exit 3, the API's 404 (one table, `runner.console.errors`)."""

    remedy = "stage the files again; a staged upload is used once and expires"


class StagedUploadInvalid(Refusal, code="upload_invalid"):
    """The files given to `stage` cannot be staged as named (or an upload cannot be promoted
    as asked): a refusal, the CLI's exit 3, the API's 400."""

    remedy = "give each attachment a simple name and files with distinct file names"


class StagedUploadInUse(Refusal, code="upload_in_use"):
    """Another launch or answer is attaching this upload to its run right now (SPEC §8: a
    staged upload is used once). A refusal: the CLI's exit 3, the API's 409."""

    remedy = (
        "stage the file again for this run; the upload is free again only if the other launch fails"
    )


class StagingStore:
    """Staged uploads on a `RunStore` (records) and a `BlobStore` (bytes)."""

    def __init__(self, runs: RunStore, blobs: BlobStore) -> None:
        self._runs = runs
        self._blobs = blobs

    async def stage(self, tenant: str, files: Mapping[str, Path]) -> StagedUpload:
        """Upload `files` (attachment name → local file) and record them for `tenant`."""
        plan = _plan(tenant, files)
        upload_id = secrets.token_hex(16)
        written: list[str] = []
        try:
            staged: list[StagedFile] = []
            for name, filename, path in plan:
                key = f"uploads/{upload_id}/{filename}"
                digest, size = await asyncio.to_thread(sha256_file, path)
                written.append(key)
                info = await self._blobs.put_file(key, path)
                if info.size != size:
                    raise StagedUploadInvalid(f"{path} changed while it was being staged")
                staged.append(
                    StagedFile(name=name, filename=filename, bytes=size, sha256=digest, key=key)
                )
            record = StagedUpload(id=upload_id, tenant=tenant, files=staged, created_at=utcnow())
            await self._runs.put_staged_upload(record)
        except BaseException:
            await self._delete_keys(written, why=f"staging {upload_id} failed")
            raise
        return record

    async def open(self, upload_id: str, tenant: str, dest_dir: Path) -> dict[str, Path]:
        """Download the upload's files into `dest_dir` (as their file names), each checked
        against its recorded sha256. Returns attachment name → path."""
        record = await self._record(upload_id, tenant)
        dest_dir = Path(dest_dir)
        opened: dict[str, Path] = {}
        for staged in record.files:
            dest = dest_dir / staged.filename
            await self._fetch_checked(record.id, staged, dest)
            opened[staged.name] = dest
        return opened

    async def get(self, upload_id: str, tenant: str) -> StagedUpload:
        """The tenant's staged upload; `StagedUploadNotFound` when it has none by that id."""
        return await self._record(upload_id, tenant)

    async def discard(self, upload_id: str, tenant: str) -> bool:
        """Delete the upload's bytes, then its record. False if `tenant` has no such upload."""
        record = await self._runs.get_staged_upload(upload_id, tenant)
        if record is None:
            return False
        await self._discard(record)
        return True

    async def reap(self, older_than: timedelta, now: datetime) -> int:
        """Discard every upload (any tenant) created before `now - older_than`; returns how many.
        An upload that cannot be discarded is logged and skipped, so one broken upload does not
        stop the others."""
        if now.tzinfo is None:
            raise ValueError("reap needs a timezone-aware `now`")
        cutoff = now - older_than
        reaped = 0
        seen: set[str] = set()
        while True:
            batch = await self._runs.list_staged_uploads_before(cutoff, limit=_REAP_BATCH)
            fresh = [record for record in batch if record.id not in seen]
            for record in fresh:
                seen.add(record.id)
                try:
                    await self._discard(record)
                except StoreError as exc:
                    log.warning("cannot reap staged upload %s: %s", record.id, exc)
                    continue
                reaped += 1
            if not fresh or len(batch) < _REAP_BATCH:
                return reaped

    async def promote(
        self,
        upload_id: str,
        tenant: str,
        run_id: str,
        *,
        rename: str | None = None,
        discard: bool = True,
    ) -> list[StagedFile]:
        """Copy the upload's bytes to `runs/<run_id>/attachments/<name>` and discard the upload
        (unless `discard=False`: a caller promoting several uploads discards them once all
        landed, so a failure part-way leaves every upload id usable for a retry). Returns the
        files with their new keys. The upload is claimed for `run_id` first: another run's claim
        refuses it (`StagedUploadInUse`). On failure the copies are removed and the claim
        released, the upload left as it was. `rename` gives a one-file upload the attachment
        name the launch chose (`--attach name=upload:ID`)."""
        try:
            validate_segment(run_id, what="run id")
            if rename is not None:
                validate_segment(rename, what="attachment name")
        except BlobKeyInvalid as exc:
            raise StagedUploadInvalid(exc.message) from exc
        record = await self._record(upload_id, tenant)
        if rename is not None and len(record.files) != 1:
            raise StagedUploadInvalid(
                f"upload {upload_id!r} holds {len(record.files)} files; only a one-file "
                "upload can be attached under a new name"
            )
        await self._claim(record, run_id)
        try:
            return await self._promote(record, run_id, rename=rename, discard=discard)
        except BaseException:
            await self.release(upload_id, tenant, run_id)
            raise

    async def release(self, upload_id: str, tenant: str, run_id: str) -> None:
        """Give back `run_id`'s claim on the upload (best effort: a failure here is logged, and
        the claim ends when the upload is reaped). For a caller that promoted with
        `discard=False` and then failed."""
        try:
            await self._runs.release_staged_upload(upload_id, tenant, run_id)
        except StoreError as exc:
            log.warning("cannot release staged upload %s from run %s: %s", upload_id, run_id, exc)

    async def _claim(self, record: StagedUpload, run_id: str) -> None:
        if await self._runs.claim_staged_upload(record.id, record.tenant, run_id):
            return
        holder = await self._runs.get_staged_upload(record.id, record.tenant)
        if holder is None or holder.claimed_by is None:
            raise StagedUploadNotFound(f"staged upload {record.id!r} was used meanwhile")
        raise StagedUploadInUse(
            f"staged upload {record.id!r} is being attached to run {holder.claimed_by}"
        )

    async def _promote(
        self, record: StagedUpload, run_id: str, *, rename: str | None, discard: bool
    ) -> list[StagedFile]:
        upload_id = record.id
        if rename is not None:
            record = record.model_copy(
                update={"files": [record.files[0].model_copy(update={"name": rename})]}
            )
        promoted: list[StagedFile] = []
        workdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="runfleet-promote-"))
        try:
            for index, staged in enumerate(record.files):
                local = workdir / str(index)
                await self._fetch_checked(record.id, staged, local)
                key = f"runs/{run_id}/attachments/{staged.name}"
                promoted.append(staged.model_copy(update={"key": key}))
                await self._blobs.put_file(key, local)
                await asyncio.to_thread(local.unlink)
        except BaseException:
            await self._delete_keys(
                [f.key for f in promoted], why=f"promoting {upload_id} to run {run_id} failed"
            )
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        if not discard:
            return promoted
        try:
            await self._discard(record)
        except StoreError as exc:
            # The run has its attachments; the leftover upload is reaped later.
            log.warning("promoted staged upload %s but could not discard it: %s", upload_id, exc)
        return promoted

    # -- internals -----------------------------------------------------------------------------

    async def _record(self, upload_id: str, tenant: str) -> StagedUpload:
        record = await self._runs.get_staged_upload(upload_id, tenant)
        if record is None:
            raise StagedUploadNotFound(f"no staged upload {upload_id!r} for tenant {tenant!r}")
        return record

    async def _discard(self, record: StagedUpload) -> None:
        # Bytes first: a crash in between leaves a record without bytes (reaped later), never
        # bytes without a record.
        for staged in record.files:
            await self._blobs.delete(staged.key)
        await self._runs.delete_staged_upload(record.id, record.tenant)

    async def _fetch_checked(self, upload_id: str, staged: StagedFile, dest: Path) -> None:
        """The staged bytes, as recorded: lost bytes read as a missing upload (the record is
        reaped later), other bytes are `StoreCorrupt`."""
        try:
            await fetch_checked(
                self._blobs,
                staged.key,
                dest,
                sha256=staged.sha256,
                size=staged.bytes,
                what=f"staged upload {upload_id!r}: {staged.name!r}",
            )
        except BlobNotFound as exc:
            raise StagedUploadNotFound(
                f"staged upload {upload_id!r} has lost the bytes of {staged.name!r}"
            ) from exc

    async def _delete_keys(self, keys: list[str], *, why: str) -> None:
        """Best effort: the failure that brought us here is what the caller must see."""
        for key in keys:
            with contextlib.suppress(StoreError):
                await self._blobs.delete(key)
        if keys:
            log.debug("%s; removed %d blob(s)", why, len(keys))


def _plan(tenant: str, files: Mapping[str, Path]) -> list[tuple[str, str, Path]]:
    """Validate names before any byte moves: (name, filename, path) per file."""
    if not tenant:
        raise StagedUploadInvalid("a staged upload needs a tenant")
    plan: list[tuple[str, str, Path]] = []
    filenames: dict[str, str] = {}
    for name, raw in files.items():
        path = Path(raw)
        try:
            validate_segment(name, what="attachment name")
            validate_segment(path.name, what="file name")
        except BlobKeyInvalid as exc:
            raise StagedUploadInvalid(
                exc.message,
                remedy="name the attachment with letters, digits and '_', and the file with a"
                " bare UTF-8 name (rename or copy the file)",
            ) from exc
        if path.name in filenames:
            raise StagedUploadInvalid(
                f"attachments {filenames[path.name]!r} and {name!r} have the same file name "
                f"{path.name!r}"
            )
        filenames[path.name] = name
        plan.append((name, path.name, path))
    return plan
