"""Attachments: files an operator gives a run, delivered wherever it executes (SPEC §8, §13.11).

Written once against the `BlobStore` and `SandboxDriver` protocols, never per driver:

- **Staging and promotion** (the launch's side): names and limits are checked before any byte
  moves (`check_files`), so an over-limit file is refused with the limit named and nothing
  stored; `promote_for_launch` copies the bytes to `runs/<run_id>/attachments/<name>` before the
  run document exists, and any failure on the way is `LaunchFailed` with what it copied removed.
- **Materialisation** (the runner's side): before the sandbox starts, the run's attachments are
  fetched into a per-execution host directory as `<name>/<filename>`, each checked against its
  sha256, and made read-only. A fetch that fails is `ATTACHMENTS_UNFETCHABLE` (transient: the
  blob store may be back at the next delivery). The driver's `capabilities.attachments` says
  how the files reach the commands: `host` (the local driver opens the host path), `copy` (the
  kubernetes driver copies the directory into `/run/runfleet/attachments/` during its seed
  phase), or `none` (refused `ATTACHMENTS_UNDELIVERABLE`, each attachment named and dropped).
- **Templates**: `{{ attachments.x.path }}` is the path the node's commands can open. A node
  that cannot open any (a `call` node runs on the host, outside the sandbox) fails
  `ATTACHMENT_PATH_UNAVAILABLE` before it runs; an attachment the run does not hold renders
  empty; `{{ attachments.x.url }}` exists where the blob store signs URLs (`UrlSigner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from engine.failures import FailureCode
from engine.sandbox.errors import SandboxError
from engine.sandbox.protocols import SandboxCapabilities, SandboxDriver, SeedDir
from store import BlobStore, ResumeSpec, RunDocument
from store.errors import Refusal, RunfleetError, StoreError
from store.models import StagedFile, StagedUpload
from store.staging import StagedUploadNotFound, StagingStore

__all__ = [
    "SANDBOX_DIR",
    "AttachmentLimits",
    "AttachmentNameInvalid",
    "AttachmentPathUnavailable",
    "AttachmentTooLarge",
    "AttachmentsUndeliverable",
    "AttachmentsUnfetchable",
    "LaunchFailed",
    "Prepared",
    "TooManyAttachments",
    "Unavailable",
    "UrlSigner",
    "check_files",
    "check_name",
    "delivery_of",
    "materialise",
    "prepare",
    "promote_for_launch",
    "remove_dir",
    "stage",
    "template_scope",
]

NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
SANDBOX_DIR = "/run/runfleet/attachments"
Delivery = Literal["host", "copy", "none"]
URL_TTL_S = 3600
"""How long a presigned attachment URL stays valid."""
_CHUNK = 1024 * 1024


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


class AttachmentsUnfetchable(SandboxError, failure_code=FailureCode.ATTACHMENTS_UNFETCHABLE):
    """The blob store did not give the attachments back (transient: retried after 2 min)."""


class AttachmentsUndeliverable(SandboxError, failure_code=FailureCode.ATTACHMENTS_UNDELIVERABLE):
    """The sandbox driver can neither open the host files nor copy them in."""


class AttachmentPathUnavailable(SandboxError, failure_code=FailureCode.ATTACHMENT_PATH_UNAVAILABLE):
    """A node names `attachments.x.path` where no path to `x` can be opened."""


@dataclass(frozen=True, slots=True)
class AttachmentLimits:
    max_bytes: int = 50 * 1024 * 1024
    """`RUNFLEET_ATTACHMENT_MAX_BYTES`: one file."""
    max_count: int = 32
    """`RUNFLEET_ATTACHMENTS_MAX_COUNT`: one run."""


@runtime_checkable
class UrlSigner(Protocol):
    """A blob store that can hand out a time-limited URL to an object (S3 presigned)."""

    async def presigned_url(self, key: str, expires_s: int) -> str:
        """A URL that reads `key` for `expires_s` seconds."""
        ...


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
            size = Path(path).stat().st_size
        except OSError as exc:
            raise AttachmentNameInvalid(f"attachment {name!r}: cannot read {path}: {exc}") from exc
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

    A refusal (name, count, size) is raised as it is. Any other failure removes what was
    promoted, discards what this call staged (a given upload id stays, for a retry) and raises
    `LaunchFailed`: the caller has not created the run yet, so nothing is queued."""
    for name in uploads:
        check_name(name)
    duplicate = set(paths) & set(uploads)
    if duplicate:
        raise AttachmentNameInvalid(f"attachment {sorted(duplicate)[0]!r} is given twice")
    check_files(paths, limits, already=len(uploads))
    promoted: list[StagedFile] = []
    staged: StagedUpload | None = None
    try:
        if paths:
            staged = await staging.stage(tenant, paths)
            promoted += await staging.promote(staged.id, tenant, run_id)
            staged = None  # promote discarded it
        for name, upload_id in uploads.items():
            promoted += await staging.promote(upload_id, tenant, run_id, rename=name)
    except RunfleetError as exc:
        for done in promoted:
            with contextlib.suppress(StoreError):
                await blobs.delete(done.key)
        if staged is not None:
            with contextlib.suppress(StoreError):
                await staging.discard(staged.id, tenant)
        raise LaunchFailed(f"attachments of the launch could not be promoted: {exc}") from exc
    too_big = [f for f in promoted if f.bytes > limits.max_bytes]
    if too_big:  # an upload staged under a higher limit
        for done in promoted:
            with contextlib.suppress(StoreError):
                await blobs.delete(done.key)
        raise AttachmentTooLarge(
            f"attachment {too_big[0].name!r} has {too_big[0].bytes} bytes, over "
            f"RUNFLEET_ATTACHMENT_MAX_BYTES ({limits.max_bytes})"
        )
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
    after a lost CAS finds the upload gone and the bytes in place, which is done."""
    for name, answer in uploaded_answers(run, spec).items():
        key = f"runs/{run.run_id}/attachments/{name}"
        try:
            await staging.promote(answer["upload"], run.tenant, run.run_id, rename=name)
        except StagedUploadNotFound:
            if await blobs.stat(key) is None:
                raise


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


# -- materialisation and delivery (the runner) ------------------------------------------------


def delivery_of(driver: SandboxDriver, name: str | None) -> Delivery:
    """How `driver` (for the workflow's `sandbox.driver` `name`) hands attachments over."""
    pick = getattr(driver, "driver", None)  # a `DriverRouter` answers per driver name
    caps: SandboxCapabilities = pick(name).capabilities if callable(pick) else driver.capabilities
    return caps.attachments


def node_path(attachment: StagedFile, delivery: Delivery, host_dir: Path) -> str | None:
    """The path a sandbox command opens for `attachment`, or None when there is none."""
    if delivery == "host":
        return str(host_dir / attachment.name / attachment.filename)
    if delivery == "copy":
        return f"{SANDBOX_DIR}/{attachment.name}/{attachment.filename}"
    return None


class Unavailable:
    """`attachments.x.path` where the run holds `x` but the node can open no path to it: the
    template raises `AttachmentPathUnavailable` when it reads the field."""

    __slots__ = ("name", "why")

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.why = why

    def error(self) -> AttachmentPathUnavailable:
        return AttachmentPathUnavailable(
            f"attachment {self.name!r} has no path this node can open ({self.why})"
        )


def template_scope(
    run: RunDocument,
    delivery: Delivery,
    host_dir: Path,
    *,
    in_sandbox: bool,
    urls: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """`attachments.<name>` fields for a node: `path` (or `Unavailable`), `filename`,
    `bytes`, `sha256`, and `url` when one was signed."""
    scope: dict[str, dict[str, Any]] = {}
    for attachment in run.attachments:
        path = node_path(attachment, delivery, host_dir) if in_sandbox else None
        why = "the sandbox driver cannot deliver attachments"
        if not in_sandbox:
            why = "only a tool node's commands, in the sandbox, can open an attachment"
        fields: dict[str, Any] = {
            "path": path if path is not None else Unavailable(attachment.name, why),
            "filename": attachment.filename,
            "bytes": attachment.bytes,
            "sha256": attachment.sha256,
        }
        if urls and attachment.name in urls:
            fields["url"] = urls[attachment.name]
        scope[attachment.name] = fields
    return scope


async def signed_urls(blobs: BlobStore | None, run: RunDocument) -> dict[str, str]:
    """name → a presigned URL, where the blob store signs them (else empty)."""
    if not run.attachments or not isinstance(blobs, UrlSigner):
        return {}
    return {a.name: await blobs.presigned_url(a.key, URL_TTL_S) for a in run.attachments}


async def materialise(blobs: BlobStore | None, run: RunDocument, dest: Path) -> int:
    """Fetch the run's attachments into `dest` as `<name>/<filename>`, read-only, each checked
    against its sha256; returns the bytes fetched. `AttachmentsUnfetchable` names them."""
    names = ", ".join(a.name for a in run.attachments)
    if blobs is None:
        raise AttachmentsUnfetchable(f"attachments {names}: this execution has no blob store")
    await asyncio.to_thread(remove_dir, dest)
    total = 0
    for attachment in run.attachments:
        target = dest / attachment.name / attachment.filename
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        try:
            await blobs.get_to_file(attachment.key, target)
        except StoreError as exc:
            raise AttachmentsUnfetchable(
                f"attachment {attachment.name!r} ({attachment.key}) cannot be fetched: {exc}"
            ) from exc
        digest, size = await asyncio.to_thread(_sha256, target)
        if digest != attachment.sha256 or size != attachment.bytes:
            raise AttachmentsUnfetchable(
                f"attachment {attachment.name!r} ({attachment.key}) came back with sha256 "
                f"{digest} and {size} bytes; the run holds {attachment.sha256} and "
                f"{attachment.bytes}"
            )
        total += size
    await asyncio.to_thread(_read_only, dest)
    return total


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `SandboxSpec` gets, and what `attachments_seeded` says."""

    host_dir: Path | None = None
    seed_dirs: tuple[SeedDir, ...] = ()
    names: list[str] = field(default_factory=list)
    bytes: int = 0


class Emitter(Protocol):
    async def emit(self, type: str, **data: Any) -> Any: ...


async def prepare(
    run: RunDocument, blobs: BlobStore | None, delivery: Delivery, dest: Path, events: Emitter
) -> Prepared:
    """Before the sandbox starts: refuse a driver that cannot deliver (each attachment
    dropped with an `attachment_dropped` event, all named in the error), else materialise them
    and say how the driver gets them."""
    if not run.attachments:
        return Prepared()
    names = [a.name for a in run.attachments]
    if delivery == "none":
        for name in names:
            await events.emit("attachment_dropped", name=name, reason="undeliverable")
        raise AttachmentsUndeliverable(
            f"the sandbox driver can neither open nor copy in the attachments {', '.join(names)}"
        )
    size = await materialise(blobs, run, dest)
    if delivery == "host":
        return Prepared(host_dir=dest, names=names, bytes=size)
    return Prepared(seed_dirs=(SeedDir(dest, SANDBOX_DIR),), names=names, bytes=size)


def remove_dir(path: Path) -> None:
    """Remove a materialised directory (its read-only dirs made writable first)."""
    if not path.exists():
        return
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(Path(root) / d, stat.S_IRWXU)
    with contextlib.suppress(OSError):
        os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)


def _read_only(path: Path) -> None:
    """Files 0444, directories 0555: a sandbox command can read them, not change them."""
    for root, dirs, files in os.walk(path, topdown=False):
        for f in files:
            os.chmod(Path(root) / f, 0o444)
        for d in dirs:
            os.chmod(Path(root) / d, 0o555)
    os.chmod(path, 0o555)


def _sha256(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def names_of(files: Sequence[StagedFile]) -> list[str]:
    return [f.name for f in files]


class RunAttachments:
    """One execution's view of its run's attachments, so `Execution` says each step in a line:
    sign URLs (`sign`), give templates their fields (`scope`), materialise before the sandbox
    starts (`prepare`), remove the copies at teardown (`remove`)."""

    def __init__(
        self, run: RunDocument, driver: SandboxDriver, blobs: BlobStore | None, dest: Path
    ) -> None:
        self.run = run
        self.driver = driver
        self.blobs = blobs
        self.dest = dest
        self.urls: dict[str, str] = {}

    async def sign(self) -> None:
        self.urls = await signed_urls(self.blobs, self.run)

    def scope(self, driver_name: str | None, *, in_sandbox: bool) -> dict[str, dict[str, Any]]:
        delivery = delivery_of(self.driver, driver_name)
        return template_scope(self.run, delivery, self.dest, in_sandbox=in_sandbox, urls=self.urls)

    async def prepare(self, driver_name: str | None, events: Emitter) -> Prepared:
        delivery = delivery_of(self.driver, driver_name)
        return await prepare(self.run, self.blobs, delivery, self.dest, events)

    async def remove(self) -> None:
        if self.dest.exists():
            await asyncio.to_thread(remove_dir, self.dest)
