"""Attachments: files an operator gives a run, delivered wherever it executes (SPEC §8, §13.11).

Written once against the `BlobStore` and `SandboxDriver` protocols, never per driver:

- **Staging and promotion** (the launch's side, `engine.attachment_intake`, re-exported here):
  names and limits are checked before any byte moves (`check_files`), so an over-limit file is
  refused with the limit named and nothing stored; `promote_for_launch` copies the bytes to
  `runs/<run_id>/attachments/<name>` before the run document exists, and any failure on the way
  is `LaunchFailed` with what it copied removed; `promote_answers` does the same for a resume's
  uploaded `file` answers, at the fresh claim.
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
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from engine.attachment_intake import (
    AttachmentLimits,
    AttachmentNameInvalid,
    AttachmentTooLarge,
    LaunchFailed,
    TooManyAttachments,
    answer_attachments,
    check_files,
    check_name,
    promote_answers,
    promote_for_launch,
    stage,
    uploaded_answers,
)
from engine.failures import FailureCode
from engine.sandbox.errors import SandboxError
from engine.sandbox.protocols import SandboxCapabilities, SandboxDriver, SeedDir
from store import BlobStore, RunDocument
from store.blobkeys import validate_segment
from store.checked import fetch_checked
from store.errors import BlobKeyInvalid, StoreError
from store.models import StagedFile

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
    "answer_attachments",
    "check_files",
    "check_name",
    "delivery_of",
    "materialise",
    "prepare",
    "promote_answers",
    "promote_for_launch",
    "remove_dir",
    "stage",
    "template_scope",
    "uploaded_answers",
]

SANDBOX_DIR = "/run/runfleet/attachments"
Delivery = Literal["host", "copy", "none"]
URL_TTL_S = 3600
"""How long a presigned attachment URL stays valid."""


class AttachmentsUnfetchable(SandboxError, failure_code=FailureCode.ATTACHMENTS_UNFETCHABLE):
    """The blob store did not give the attachments back (transient: retried after 2 min)."""


class AttachmentsUndeliverable(SandboxError, failure_code=FailureCode.ATTACHMENTS_UNDELIVERABLE):
    """The sandbox driver can neither open the host files nor copy them in."""


class AttachmentPathUnavailable(SandboxError, failure_code=FailureCode.ATTACHMENT_PATH_UNAVAILABLE):
    """A node names `attachments.x.path` where no path to `x` can be opened."""


@runtime_checkable
class UrlSigner(Protocol):
    """A blob store that can hand out a time-limited URL to an object (S3 presigned)."""

    async def presigned_url(self, key: str, expires_s: int) -> str:
        """A URL that reads `key` for `expires_s` seconds."""
        ...


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
        try:  # a stored name is checked again here: this is where it becomes a host path
            validate_segment(attachment.name, what="attachment name")
            validate_segment(attachment.filename, what="file name")
        except BlobKeyInvalid as exc:  # deterministic: retrying would not change the name
            raise AttachmentsUndeliverable(
                f"attachment {attachment.name!r}: {exc.message}"
            ) from exc
        target = dest / attachment.name / attachment.filename
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        try:
            await fetch_checked(
                blobs,
                attachment.key,
                target,
                sha256=attachment.sha256,
                size=attachment.bytes,
                what=f"attachment {attachment.name!r}",
            )
        except StoreError as exc:  # unreachable, gone, or other bytes: never handed over
            raise AttachmentsUnfetchable(f"attachment {attachment.name!r}: {exc}") from exc
        total += attachment.bytes
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

    async def refuse_undeliverable(
        self, driver_name: str | None, kinds: Iterable[str], events: Emitter
    ) -> str | None:
        """SPEC §13.11: a run whose sandbox driver can deliver none of its attachments is
        refused before its first node (not at its first tool node), naming them and dropping
        each; None when there is nothing to refuse (no attachments, no tool node, or a driver
        that can deliver)."""
        if not self.run.attachments or "tool" not in set(kinds):
            return None
        if delivery_of(self.driver, driver_name) != "none":
            return None
        try:
            await prepare(self.run, self.blobs, "none", self.dest, events)
        except AttachmentsUndeliverable as exc:
            return str(exc)
        return None
