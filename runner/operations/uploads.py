"""Uploads and attachments (SPEC §8, §10): stage a file for a later launch or answer, and
promote a launch's attachments to its run before the run document exists.

The rules live in `engine.attachments` (names, limits, promotion and its failure) and
`store.staging` (bytes before records, tenant scope); these operations wire them to an `Env`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine.attachments import AttachmentLimits, promote_for_launch, stage
from runner.operations.env import Env
from store.models import StagedFile, StagedUpload
from store.staging import StagingStore

UPLOAD_NAME = "file"
"""The name a one-file `runfleet upload` is staged under; the launch (`--attach x=upload:ID`)
or the answer that uses it gives it its own."""


def limits(env: Env) -> AttachmentLimits:
    """`RUNFLEET_ATTACHMENT_MAX_BYTES` and `RUNFLEET_ATTACHMENTS_MAX_COUNT`."""
    return AttachmentLimits(env.settings.attachment_max_bytes, env.settings.attachments_max_count)


async def upload(env: Env, path: Path, *, tenant: str | None = None) -> StagedUpload:
    """Stage one file (`runfleet upload FILE`); refused over the per-file limit, nothing
    stored."""
    staging = StagingStore(env.store, env.blobs)
    return await stage(staging, tenant or env.tenant, {UPLOAD_NAME: path}, limits(env))


async def promote(
    env: Env,
    run_id: str,
    *,
    paths: Mapping[str, Path],
    uploads: Mapping[str, str],
    tenant: str | None = None,
) -> list[StagedFile]:
    """A launch's attachments (`--attach name=PATH`, `--attach name=upload:ID`) promoted to
    `run_id`; `LaunchFailed` when that cannot be done (nothing is queued then)."""
    if not paths and not uploads:
        return []
    staging = StagingStore(env.store, env.blobs)
    return await promote_for_launch(
        staging,
        env.blobs,
        tenant or env.tenant,
        run_id,
        paths=paths,
        uploads=uploads,
        limits=limits(env),
    )
