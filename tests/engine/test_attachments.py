"""Attachments reach a run's nodes, or the run is refused naming them (SPEC §8, §13.11).

Real parts: the run store of each backend (`store` fixture), the filesystem blob store, the
local sandbox driver running real shell commands. The blob-store outage is a filesystem store
whose reads fail while a flag is set; the undeliverable driver is the local driver claiming it
can neither open nor copy in attachments.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine import attachments
from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.execution import Execution
from engine.failures import FailureCode
from engine.loader import LoadedWorkflow, load_workflow_file
from engine.nodes import CallContext
from engine.outcome import Failed, Finished, Outcome
from engine.sandbox.local import LocalSandboxDriver
from engine.sandbox.protocols import SandboxCapabilities
from store import Eq, Event, RunDocument, RunStore, Update
from store.blobs_fs import FilesystemBlobStore
from store.errors import StoreUnavailable
from store.models import StagedFile
from store.protocols import BlobInfo
from tests.engine.conftest import all_events, claim_new

SPEC_BYTES = b"the spec \x00\x01 binary bytes\n" * 100

READER = """\
name: reader
entry: read
nodes:
  read:
    kind: tool
    run: "cat {{ attachments.spec.path }} > copy.bin && sha256sum {{ attachments.spec.path }}"
    output: text
  write:
    kind: tool
    run: >-
      {{ writer | raw }} sh -c 'echo changed >> {{ attachments.spec.path }}'
      && echo WROTE || echo REFUSED;
      stat -c %a {{ attachments.spec.path }};
      echo [{{ attachments.ghost.path }}]
    output: text
edges:
  - from: read
    to: write
"""

CALLER = """\
name: caller
entry: call
nodes:
  call:
    kind: call
    function: tests.engine.test_attachments:echo_inputs
    inputs:
      spec: "{{ attachments.spec.path }}"
"""


async def echo_inputs(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    return dict(inputs)


class FlakyBlobs(FilesystemBlobStore):
    """The filesystem blob store with an outage switch for reads."""

    down = False

    async def get_to_file(self, key: str, path: Path) -> BlobInfo:
        if self.down:
            raise StoreUnavailable("blob store down (test outage)")
        return await super().get_to_file(key, path)


class NoDeliveryDriver(LocalSandboxDriver):
    @property
    def capabilities(self) -> SandboxCapabilities:
        return replace(super().capabilities, attachments="none")


def _load(tmp_path: Path, text: str, writer: str = "env") -> LoadedWorkflow:
    path = tmp_path / "wf.yaml"
    path.write_text(text.replace("{{ writer | raw }}", writer))
    return load_workflow_file(path)


async def _held_run(
    store: RunStore, blobs: FilesystemBlobStore, loaded: LoadedWorkflow
) -> tuple[RunDocument, str]:
    """A claimed run holding `spec` (promoted bytes under its own key)."""
    run, token = await claim_new(store, loaded)
    key = f"runs/{run.run_id}/attachments/spec"
    await blobs.put_bytes(key, SPEC_BYTES)
    held = StagedFile(
        name="spec",
        filename="spec.bin",
        bytes=len(SPEC_BYTES),
        sha256=hashlib.sha256(SPEC_BYTES).hexdigest(),
        key=key,
    )
    doc = await store.update_run(
        run.run_id, [Eq("attempt", 1)], Update(set={"attachments": [held.model_dump()]})
    )
    assert isinstance(doc, RunDocument)
    return doc, token


async def _execute(
    store: RunStore,
    run: RunDocument,
    token: str,
    tmp_path: Path,
    blobs: FilesystemBlobStore,
    driver_cls: Callable[[Path], LocalSandboxDriver] = LocalSandboxDriver,
) -> tuple[Outcome, Execution]:
    execution = Execution(
        store=store,
        run=run,
        token=token,
        driver=driver_cls(tmp_path),
        settings=EngineSettings(),
        cancel=CancelSignal(),
        data_dir=tmp_path / "data",
        blobs=blobs,
    )
    try:
        outcome = await execution.run()
    finally:
        await execution.teardown()
    return outcome, execution


def _of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.type == kind]


async def test_a_tool_node_reads_an_attachment_through_its_path_and_cannot_write_it(
    store: RunStore, tmp_path: Path
) -> None:
    # Tests run as root here, and root writes through any mode: the write is tried as `nobody`
    # when we are root, which is what a sandbox's unprivileged user would be.
    writer = "env"
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root without setpriv cannot try an unprivileged write")
        writer = f"{setpriv} --reuid=65534 --regid=65534 --clear-groups"
        os.chmod(tmp_path, 0o755)  # nobody must reach the materialised files to be refused
        os.chmod(tmp_path.parent, 0o755)
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    run, token = await _held_run(store, blobs, _load(tmp_path, READER, writer))

    outcome, execution = await _execute(store, run, token, tmp_path, blobs)

    assert isinstance(outcome, Finished), outcome
    doc = await store.get_run(run.run_id)
    assert doc.checkpoint is not None
    digest = hashlib.sha256(SPEC_BYTES).hexdigest()
    assert digest in doc.checkpoint.outputs["read"]
    written = doc.checkpoint.outputs["write"].split()
    assert written[0] == "REFUSED" and written[1] == "444", written
    assert "[]" in written  # an attachment the run does not hold renders empty
    assert await blobs.get_bytes(run.attachments[0].key) == SPEC_BYTES
    seeded = _of(await all_events(store, run.run_id), "attachments_seeded")
    assert [e.data for e in seeded] == [{"names": ["spec"], "bytes": len(SPEC_BYTES)}]
    assert not execution.attached.dest.exists()  # teardown removed the copies


COMPUTE_FIRST = """\
name: compute_first
entry: plan
nodes:
  plan:
    kind: compute
    set:
      planned: "'yes'"
  read:
    kind: tool
    run: cat {{ attachments.spec.path }}
edges:
  - from: plan
    to: read
"""


async def test_attachments_undeliverable_refuses_the_run_before_its_first_node_naming_them(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    run, token = await _held_run(store, blobs, _load(tmp_path, COMPUTE_FIRST))

    outcome, _ = await _execute(store, run, token, tmp_path, blobs, NoDeliveryDriver)

    assert isinstance(outcome, Failed)
    assert outcome.code == FailureCode.ATTACHMENTS_UNDELIVERABLE
    assert "spec" in outcome.error
    events = await all_events(store, run.run_id)
    assert [e.data for e in _of(events, "attachment_dropped")] == [
        {"name": "spec", "reason": "undeliverable"}
    ]
    assert not _of(events, "sandbox_started")  # refused before any sandbox ran
    assert not _of(events, "node_started")  # and before the first node, a compute one (§13.11)
    assert outcome.node == "plan"


async def test_attachment_path_unavailable_fails_the_node_before_it_runs_naming_it(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    run, token = await _held_run(store, blobs, _load(tmp_path, CALLER))

    outcome, _ = await _execute(store, run, token, tmp_path, blobs)

    assert isinstance(outcome, Failed)
    assert outcome.code == FailureCode.ATTACHMENT_PATH_UNAVAILABLE
    assert "'spec'" in outcome.error
    doc = await store.get_run(run.run_id)
    assert doc.checkpoint is not None and "call" not in doc.checkpoint.outputs


async def test_a_blob_store_outage_during_materialisation_parks_resumable_and_a_later_delivery_succeeds(  # noqa: E501
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FlakyBlobs(tmp_path / "blobs")
    run, token = await _held_run(store, blobs, _load(tmp_path, READER))
    blobs.down = True

    outcome, _ = await _execute(store, run, token, tmp_path, blobs)

    assert isinstance(outcome, Failed)
    assert outcome.code == FailureCode.ATTACHMENTS_UNFETCHABLE
    assert "spec" in outcome.error
    from engine.failures import FailureClass, rule_for

    assert rule_for(outcome.code).klass is FailureClass.TRANSIENT_INFRA
    assert not _of(await all_events(store, run.run_id), "sandbox_started")

    blobs.down = False  # the next execution (a later delivery) on the same checkpoint
    again = await store.get_run(run.run_id)
    second, _ = await _execute(store, again, token, tmp_path, blobs)
    assert isinstance(second, Finished), second


async def test_a_fetched_attachment_whose_bytes_differ_is_unfetchable_never_handed_over(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    run, token = await _held_run(store, blobs, _load(tmp_path, READER))
    await blobs.put_bytes(run.attachments[0].key, b"tampered")

    outcome, execution = await _execute(store, run, token, tmp_path, blobs)

    assert isinstance(outcome, Failed)
    assert outcome.code == FailureCode.ATTACHMENTS_UNFETCHABLE
    assert "sha256" in outcome.error
    assert not execution.attached.dest.exists()


async def test_a_stored_attachment_whose_filename_leaves_its_directory_is_never_written(
    store: RunStore, tmp_path: Path
) -> None:
    """Found by review: a file answer's filename `../../x` reached the run's attachments and
    `materialise` wrote the bytes outside its directory. Answers refuse such a name now; a
    document that holds one anyway is refused here too, deterministically."""
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    data = b"bytes"
    await blobs.put_bytes("runs/r1/attachments/doc", data)
    held = StagedFile(
        name="doc",
        filename="../../escaped.txt",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        key="runs/r1/attachments/doc",
    )
    claimed, _ = await claim_new(store, _load(tmp_path, READER))
    run = claimed.model_copy(update={"attachments": [held]})
    dest = tmp_path / "exec" / "attachments"
    with pytest.raises(attachments.AttachmentsUndeliverable, match="one non-empty path segment"):
        await attachments.materialise(blobs, run, dest)
    assert not (tmp_path / "exec" / "escaped.txt").exists()
    assert not (tmp_path / "escaped.txt").exists()


def test_template_scope_gives_the_sandbox_path_each_delivery_opens(tmp_path: Path) -> None:
    held = StagedFile(name="spec", filename="a.pdf", bytes=1, sha256="0" * 64, key="k")
    run = RunDocument.model_validate(
        {
            "run_id": "r1",
            "workflow": {"name": "w", "source": "", "source_hash": "0" * 64},
            "status": "running",
            "attempt_at": "2026-01-01T00:00:00Z",
            "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z",
            "attachments": [held.model_dump()],
        }
    )
    host = attachments.template_scope(run, "host", tmp_path, in_sandbox=True)
    copy = attachments.template_scope(run, "copy", tmp_path, in_sandbox=True, urls={"spec": "u"})
    assert host["spec"]["path"] == str(tmp_path / "spec" / "a.pdf")
    assert copy["spec"]["path"] == "/run/runfleet/attachments/spec/a.pdf"
    assert copy["spec"]["url"] == "u" and "url" not in host["spec"]


def _fetch(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        data: bytes = resp.read()
    return data


async def test_attachment_url_renders_a_presigned_s3_url_that_reads_the_bytes(
    tmp_path: Path,
) -> None:
    import asyncio

    from engine.templates import render
    from store.blobs_s3 import S3BlobStore
    from tests.support.s3server import running_s3_server

    run = RunDocument.model_validate(
        {
            "run_id": "r1",
            "workflow": {"name": "w", "source": "", "source_hash": "0" * 64},
            "status": "running",
            "attempt_at": "2026-01-01T00:00:00Z",
            "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z",
            "attachments": [
                {
                    "name": "spec",
                    "filename": "spec.bin",
                    "bytes": len(SPEC_BYTES),
                    "sha256": hashlib.sha256(SPEC_BYTES).hexdigest(),
                    "key": "runs/r1/attachments/spec",
                }
            ],
        }
    )
    with running_s3_server() as server:
        blobs = S3BlobStore(
            await server.new_bucket(),
            "att",
            endpoint_url=server.endpoint_url,
            region=server.region,
            session=server.session(),
        )
        try:
            await blobs.put_bytes("runs/r1/attachments/spec", SPEC_BYTES)
            urls = await attachments.signed_urls(blobs, run)
            scope = attachments.template_scope(run, "copy", tmp_path, in_sandbox=False, urls=urls)
            url = render("{{ attachments.spec.url }}", {"attachments": scope}, shell=False)
            assert url.startswith("http") and "Expires" in url
            # SigV4, also in us-east-1, where botocore's default presign is SigV2
            assert "X-Amz-Signature=" in url and "AWSAccessKeyId=" not in url, url
            assert await asyncio.to_thread(_fetch, url) == SPEC_BYTES
        finally:
            await blobs.close()
    assert await attachments.signed_urls(FilesystemBlobStore(tmp_path), run) == {}
