"""A spilled output is written once (SPEC §2: the checkpoint keeps the key).

An execution that lost its lease mid-node still finishes the node and spills its output to the
same key as its adopter (same node, same progress). Here the two really race: the stale
execution waits inside its call node, an adopter takes the lease (the CAS a claim makes) and
runs the node too, and the test chooses which of the two spills first. Whatever the order, the
key the live checkpoint names holds the adopter's bytes, and no blob is overwritten.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.execution import Execution
from engine.loader import LoadedWorkflow, load_workflow_file
from engine.nodes import CallContext
from engine.outcome import CancelReason, Finished, Interrupted, Outcome
from engine.sandbox.local import LocalSandboxDriver
from store import Eq, RunDocument, RunStore, Update
from store.blobs_fs import FilesystemBlobStore
from tests.engine.conftest import claim_new

DEADLINE_S = 15.0
CAP = 64
"""Bytes a node's output may take in the checkpoint: every output here spills."""

SPILL = """\
name: spill
entry: big
nodes:
  big:
    kind: call
    function: tests.engine.test_spilled_outputs:big_output
"""


@dataclass
class Turn:
    """One execution's call of `big`: `payload` repeated, after `release` when it is set."""

    payload: str
    release: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)


_turns: dict[str, list[Turn]] = defaultdict(list)


async def big_output(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """The run's next turn: the first execution to call takes the first turn, and so on."""
    turn = _turns[ctx.run_id].pop(0)
    turn.entered.set()
    if turn.release is not None:
        await turn.release.wait()
    return {"payload": turn.payload * 50}


def _load(tmp_path: Path) -> LoadedWorkflow:
    path = tmp_path / "spill.yaml"
    path.write_text(SPILL)
    return load_workflow_file(path)


def _execution(
    store: RunStore, run: RunDocument, token: str, blobs: FilesystemBlobStore, data: Path
) -> Execution:
    return Execution(
        store=store,
        run=run,
        token=token,
        driver=LocalSandboxDriver(data),
        settings=EngineSettings(output_cap=CAP),
        cancel=CancelSignal(),
        data_dir=data,
        blobs=blobs,
    )


async def _run(execution: Execution) -> Outcome:
    try:
        return await asyncio.wait_for(execution.run(), DEADLINE_S)
    finally:
        await execution.teardown()


async def _adopt(store: RunStore, run: RunDocument, token: str) -> tuple[RunDocument, str]:
    """What an adopter's claim does: one CAS that puts its own token in `lease.token`."""
    mine = uuid.uuid4().hex
    adopted = await store.update_run(
        run.run_id,
        [Eq("lease.token", token)],
        Update(set={"lease.token": mine, "lease.owner": "adopter"}),
    )
    assert isinstance(adopted, RunDocument)
    return adopted, mine


@dataclass
class Race:
    run_id: str
    stale_token: str
    live_token: str
    stale: Outcome
    live: Outcome


async def _race(
    store: RunStore, blobs: FilesystemBlobStore, tmp_path: Path, *, stale_spills_first: bool
) -> Race:
    run, token = await claim_new(store, _load(tmp_path))
    release = asyncio.Event()
    _turns[run.run_id] = [Turn("stale", release), Turn("live")]
    stale_task = asyncio.ensure_future(
        _run(_execution(store, run, token, blobs, tmp_path / "stale"))
    )
    try:
        await asyncio.wait_for(_turns[run.run_id][0].entered.wait(), DEADLINE_S)
        adopted, mine = await _adopt(store, run, token)
        live_execution = _execution(store, adopted, mine, blobs, tmp_path / "live")
        if stale_spills_first:
            release.set()
            stale = await asyncio.wait_for(stale_task, DEADLINE_S)
            live = await _run(live_execution)
        else:
            live = await _run(live_execution)
            release.set()
            stale = await asyncio.wait_for(stale_task, DEADLINE_S)
    finally:
        stale_task.cancel()
        _turns.pop(run.run_id, None)
    return Race(run.run_id, token, mine, stale, live)


def _bytes_of(payload: str) -> bytes:
    return f'{{"payload": "{payload * 50}"}}'.encode()


async def _checkpointed_key(store: RunStore, run_id: str) -> str:
    doc = await store.get_run(run_id)
    key: str = doc.checkpoint.outputs["big"]["$blob"]
    return key


async def test_a_spilled_output_is_never_overwritten_by_a_fenced_execution(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    race = await _race(store, blobs, tmp_path, stale_spills_first=False)

    assert race.stale == Interrupted(CancelReason.LEASE_LOST)
    assert isinstance(race.live, Finished), race.live
    key = await _checkpointed_key(store, race.run_id)
    assert key == f"runs/{race.run_id}/outputs/big/0"  # SPEC §2's key when nobody was first
    assert await blobs.get_bytes(key) == _bytes_of("live")
    # The fenced execution's spill went beside it, under its own token, named by nothing.
    assert await blobs.get_bytes(f"{key}.{race.stale_token}") == _bytes_of("stale")


async def test_a_spill_after_a_fenced_executions_spill_goes_beside_it_not_over_it(
    store: RunStore, tmp_path: Path
) -> None:
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    race = await _race(store, blobs, tmp_path, stale_spills_first=True)

    assert race.stale == Interrupted(CancelReason.LEASE_LOST)
    assert isinstance(race.live, Finished), race.live
    canonical = f"runs/{race.run_id}/outputs/big/0"
    key = await _checkpointed_key(store, race.run_id)
    assert key == f"{canonical}.{race.live_token}"
    assert await blobs.get_bytes(key) == _bytes_of("live")
    assert await blobs.get_bytes(canonical) == _bytes_of("stale")  # written once, kept


async def test_a_spill_whose_key_already_holds_the_same_bytes_reuses_the_key(
    store: RunStore, tmp_path: Path
) -> None:
    """The create of an earlier try whose reply was lost left these very bytes: no copy."""
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    run, token = await claim_new(store, _load(tmp_path))
    canonical = f"runs/{run.run_id}/outputs/big/0"
    await blobs.put_bytes(canonical, _bytes_of("same"))
    _turns[run.run_id] = [Turn("same")]
    try:
        outcome = await _run(_execution(store, run, token, blobs, tmp_path / "data"))
    finally:
        _turns.pop(run.run_id, None)

    assert isinstance(outcome, Finished), outcome
    assert await _checkpointed_key(store, run.run_id) == canonical
    assert [b.key for b in await blobs.list(f"runs/{run.run_id}/outputs/")] == [canonical]
