"""Uploads and attachments (SPEC §8, §10): stage a file for a later launch or answer, and
promote a launch's attachments to its run before the run document exists.

The rules live in `engine.attachments` (names, limits, promotion and its failure) and
`store.staging` (bytes before records, tenant scope); these operations wire them to an `Env`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from engine.attachments import AttachmentLimits, promote_for_launch, stage
from engine.loader import load_stored_workflow
from engine.resume import ResumeRequest
from engine.workflow import HumanNode
from runner.operations.env import Env
from store.models import RunDocument, StagedFile, StagedUpload
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


async def staged_upload(env: Env, upload_id: str, *, tenant: str | None = None) -> StagedUpload:
    """The tenant's staged upload `upload_id` (what an answer or a launch names);
    `StagedUploadNotFound` — a refusal, the same code for the CLI and the API — when the tenant
    has none by that id (another tenant's reads as missing)."""
    return await StagingStore(env.store, env.blobs).get(upload_id, tenant or env.tenant)


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


async def stage_file_answers(
    env: Env, run: RunDocument, request: ResumeRequest, *, tenant: str
) -> ResumeRequest:
    """`resume --answer field=@PATH` through the queue (SPEC §6.4, §8): each `file` answer
    that names a local file is staged here, on the operator's machine, and sent as its upload
    id (with what was staged); the runner that claims the resume promotes it to the run and
    never opens a path of this machine. Anything else is left for the resume's own checks."""
    pending = run.checkpoint.pending_interaction if run.checkpoint else None
    if pending is None or run.tenant != tenant:
        return request
    workflow = load_stored_workflow(run.workflow.source, f"run {run.run_id}").workflow
    node = workflow.nodes.get(str(pending.get("node")))
    if not isinstance(node, HumanNode):
        return request
    cli, typed = dict(request.cli_answers), dict(request.answers)
    base = request.answers_base_dir or Path.cwd()
    staging = StagingStore(env.store, env.blobs)
    for question in node.questions:
        if question.type != "file":
            continue
        path = _local_path(cli.get(question.name, typed.get(question.name)), base)
        if path is None:
            continue
        staged = await stage(staging, tenant, {question.name: path}, limits(env))
        (file,) = staged.files
        cli.pop(question.name, None)
        typed[question.name] = {
            "upload": staged.id,
            "filename": file.filename,
            "bytes": file.bytes,
            "sha256": file.sha256,
        }
    return replace(request, answers=typed, cli_answers=cli)


def _local_path(value: object, base: Path) -> Path | None:
    """`@PATH`, `PATH` or `{"path": PATH}` naming an existing file, else None."""
    if isinstance(value, Mapping) and isinstance(value.get("path"), str):
        value = value["path"]
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    path = Path(text.removeprefix("@")).expanduser()
    path = path if path.is_absolute() else base / path
    return path if path.is_file() else None
