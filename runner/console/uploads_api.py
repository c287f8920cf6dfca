"""Uploads over the HTTP API (SPEC §8, v2.2 §10c): stage a file for a later launch's
attachments (`POST /api/v1/uploads`), and a resume's `file` answers read from the caller's
staged uploads. An unknown upload id is the operations' refusal (`upload_not_found`), raised by
`runner.operations.uploads` for an answer and by the launch itself for an attachment.

The bytes are streamed to a temporary file (never held in memory whole, never past the
per-file limit) and staged through `runner.operations.uploads`, the same path as `runfleet
upload`; the staging store keeps the upload under the caller's tenant, so another tenant's
upload id is `upload_not_found` — as one that never existed.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.attachments import AttachmentTooLarge
from engine.errors import AnswersInvalid
from engine.loader import load_stored_workflow
from engine.workflow import HumanNode
from runner.console.models import UploadFileOut, UploadOut
from runner.console.routing import Call, Param, Reply, Route, invalid
from runner.operations import uploads as upload_ops
from store import RunDocument
from store.blobkeys import validate_segment
from store.errors import BlobKeyInvalid

CHUNK = 256 * 1024
FILENAME_MAX = 255


def filename_of(raw: str | None) -> str:
    """The file's name as given (`?filename=`), as a bare name: no directory, no NUL."""
    name = (raw or "upload").strip()
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise invalid(f"filename: {name[:40]!r} is not a file name", "give a bare file name")
    if len(name) > FILENAME_MAX or len(name.encode("utf-8", "surrogatepass")) > FILENAME_MAX:
        raise invalid(f"filename: longer than {FILENAME_MAX} characters or UTF-8 bytes")
    try:
        return validate_segment(name, what="filename")
    except BlobKeyInvalid as exc:
        raise invalid(exc.message, "give a bare file name") from None


async def upload(call: Call) -> Reply:
    name = filename_of(call.query_str("filename"))
    limit = upload_ops.limits(call.env).max_bytes
    with tempfile.TemporaryDirectory(prefix="runfleet-upload-") as tmp:
        path = Path(tmp) / name
        out = await asyncio.to_thread(path.open, "wb")
        try:
            total = 0
            async for chunk in call.request.content.iter_chunked(CHUNK):
                total += len(chunk)
                if total > limit:
                    raise AttachmentTooLarge(f"{name}: more than {limit} bytes")
                await asyncio.to_thread(out.write, chunk)
        finally:
            await asyncio.to_thread(out.close)
        staged = await upload_ops.upload(call.env, path)
    return Reply(
        UploadOut(
            upload_id=staged.id,
            files=[
                UploadFileOut(filename=f.filename, bytes=f.bytes, sha256=f.sha256)
                for f in staged.files
            ],
        ),
        201,
    )


FILE_ANSWER_FORM = '{"upload": "<id from POST /api/v1/uploads>"}'


def file_questions(run: RunDocument) -> list[str]:
    """The `file` questions of the node the run waits at, read as the operations read them
    (`uploads.stage_file_answers`: the run's stored workflow, the pending node)."""
    pending = run.checkpoint.pending_interaction if run.checkpoint else None
    if not pending:
        return []
    workflow = load_stored_workflow(run.workflow.source, f"run {run.run_id}").workflow
    node = workflow.nodes.get(str(pending.get("node")))
    if not isinstance(node, HumanNode):
        return []
    return [q.name for q in node.questions if q.type == "file"]


async def file_answers(call: Call, run: RunDocument, answers: Mapping[str, Any]) -> dict[str, Any]:
    """The answers with each `file` answer made the queue's form (SPEC §6.4, §8: the staged
    upload's id, filename, size and digest, read from the caller's own staged upload).

    Over HTTP a file answer is an upload id and nothing else: the operations read a path
    answer from the local disk (right for `runfleet resume --answer f=@PATH` on the operator's
    machine), and on a server that would hand a caller any file the server can read."""
    out = dict(answers)
    for name in file_questions(run):
        if name not in out:
            continue
        value = out[name]
        upload_id = value.get("upload") if isinstance(value, Mapping) else None
        if not isinstance(upload_id, str) or not upload_id:
            raise AnswersInvalid(name, f"over the API a file answer is {FILE_ANSWER_FORM}")
        staged = await upload_ops.staged_upload(call.env, upload_id, tenant=call.principal.tenant)
        if len(staged.files) != 1:
            raise AnswersInvalid(
                name, f"upload {upload_id!r} holds {len(staged.files)} files, not 1"
            )
        (file,) = staged.files
        out[name] = {
            "upload": staged.id,
            "filename": file.filename,
            "bytes": file.bytes,
            "sha256": file.sha256,
        }
    return out


UPLOAD_ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/api/v1/uploads",
        "upload",
        "Stage a file for a launch",
        upload,
        UploadOut,
        params=(
            Param(
                "filename",
                "query",
                {"type": "string", "minLength": 1, "maxLength": FILENAME_MAX},
                "the file's name",
            ),
        ),
        writes=True,
        status=201,
        raw_body=True,
    ),
)
