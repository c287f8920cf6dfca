"""A tool node's stdout over the output cap spills to the blob store (SPEC §2: "larger outputs
spill to the blob store"), as a `call` node's does. Found by a walkthrough: stdout was captured
only up to the cap, so a tool's big output failed `OUTPUT_TOO_LARGE` although a blob store was
there to take it. Bounded still: past `RUNFLEET_OUTPUT_SPILL_MAX` it fails, naming the setting."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.errors import ExpressionError, TemplateError
from engine.execution import Execution
from engine.expressions import evaluate
from engine.failures import FailureCode
from engine.loader import load_workflow_file
from engine.outcome import Failed, Finished, Outcome
from engine.sandbox.local import LocalSandboxDriver
from engine.templates import render
from store import RunStore
from store.blobs_fs import FilesystemBlobStore
from tests.engine.conftest import claim_new

CAP = 64
BIG = 300
TOOL = f"""\
name: big-tool
entry: big
nodes:
  big:
    kind: tool
    run: head -c {BIG} /dev/zero | tr '\\0' a
"""


async def _run(
    store: RunStore, tmp_path: Path, blobs: FilesystemBlobStore | None, spill_max: int
) -> tuple[Outcome, str]:
    path = tmp_path / "big.yaml"
    path.write_text(TOOL)
    run, token = await claim_new(store, load_workflow_file(path))
    execution = Execution(
        store=store,
        run=run,
        token=token,
        driver=LocalSandboxDriver(tmp_path / "data"),
        settings=EngineSettings(output_cap=CAP, output_spill_max=spill_max),
        cancel=CancelSignal(),
        data_dir=tmp_path / "data",
        blobs=blobs,
    )
    try:
        return await asyncio.wait_for(execution.run(), 30), run.run_id
    finally:
        await execution.teardown()


async def test_a_tool_output_over_the_cap_spills_to_the_blob_store(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    outcome, run_id = await _run(store, tmp_path, blobs, spill_max=1024)
    assert isinstance(outcome, Finished), outcome
    stored = (await store.get_run(run_id)).checkpoint
    assert stored is not None
    spilled = stored.outputs["big"]
    assert spilled["$blob"] == f"runs/{run_id}/outputs/big/0"
    assert json.loads(await blobs.get_bytes(spilled["$blob"])) == "a" * BIG


async def test_a_tool_output_over_the_spill_bound_fails_naming_it(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    outcome, _ = await _run(store, tmp_path, blobs, spill_max=BIG - 1)
    assert isinstance(outcome, Failed) and outcome.code is FailureCode.OUTPUT_TOO_LARGE
    assert "RUNFLEET_OUTPUT_SPILL_MAX" in outcome.error


async def test_without_a_blob_store_a_tool_output_over_the_cap_fails_naming_the_cap(
    store: RunStore, tmp_path: Path
) -> None:
    outcome, _ = await _run(store, tmp_path, None, spill_max=1024)
    assert isinstance(outcome, Failed) and outcome.code is FailureCode.OUTPUT_TOO_LARGE
    assert "RUNFLEET_OUTPUT_CAP" in outcome.error


def test_a_template_or_expression_reading_into_a_spilled_output_names_the_spill() -> None:
    """What a later node sees of a spilled output is `{"$blob": KEY, "bytes": N}`; reading a
    field of it failed "'dict object' has no attribute 'stdout'" without a word of why (found
    by a walkthrough). The error names the spilled output and what to do instead."""
    context = {"outputs": {"big": {"$blob": "runs/r/outputs/big/0", "bytes": 2_000_000}}}

    with pytest.raises(TemplateError) as rendered:
        render("echo {{ outputs.big.stdout }}", context, shell=True)
    with pytest.raises(ExpressionError) as evaluated:
        evaluate("outputs['big']['rows'] > 3", context)

    for error in (str(rendered.value), str(evaluated.value)):
        assert "outputs.big: over RUNFLEET_OUTPUT_CAP, kept in the blob store" in error
        assert "write big results to a file" in error
    # No spill, no hint.
    with pytest.raises(TemplateError) as plain:
        render("{{ outputs.small.x }}", {"outputs": {"small": {"y": 1}}}, shell=False)
    assert "blob store" not in str(plain.value)


ENDLESS = """\
name: endless
entry: loud
nodes:
  loud:
    kind: tool
    timeout: 60s
    retry: {max: 0}
    run: yes 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
"""


async def test_a_tool_printing_without_end_is_stopped_at_its_output_bound_and_keeps_few_events(
    store: RunStore, tmp_path: Path
) -> None:
    """A scale drill: a tool that printed without end ran to its timeout (retried as
    TIMEOUT) and every byte became a `node_output` event — 2.4 GB in the store from one run.
    The first byte past the capture bound stops it, and the events keep a bounded share."""
    path = tmp_path / "endless.yaml"
    path.write_text(ENDLESS)
    run, token = await claim_new(store, load_workflow_file(path))
    events_max = 64 * 1024
    execution = Execution(
        store=store,
        run=run,
        token=token,
        driver=LocalSandboxDriver(tmp_path / "data"),
        settings=EngineSettings(
            output_cap=CAP, output_spill_max=512 * 1024, output_events_max=events_max
        ),
        cancel=CancelSignal(),
        data_dir=tmp_path / "data",
        blobs=FilesystemBlobStore(tmp_path / "blobs"),
    )
    try:
        outcome = await asyncio.wait_for(execution.run(), 50)
    finally:
        await execution.teardown()
    assert isinstance(outcome, Failed), outcome
    assert outcome.code is FailureCode.OUTPUT_TOO_LARGE  # not TIMEOUT: it was stopped
    assert "RUNFLEET_OUTPUT_SPILL_MAX" in outcome.error and "stopped" in outcome.error
    outputs = [e for e in await store.read_events(run.run_id, 0, 10_000) if e.type == "node_output"]
    kept = sum(len(e.data["text"].encode()) for e in outputs if not e.data.get("truncated"))
    assert kept <= events_max
    last = outputs[-1]
    assert last.data.get("truncated") is True and "RUNFLEET_OUTPUT_EVENTS_MAX" in last.data["text"]
