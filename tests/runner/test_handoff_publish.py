"""A drain's handoff whose publish fails (SPEC §5.6, §5.9): the run stays `queued` with no
publication for its new attempt, which the sweeper republishes. Found by a cluster
walkthrough: with quorum lost, that was said only in the runner's log, and the stalled runs'
histories gave no reason. Now the run's events say it (`run_publish_failed`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from publisher import ensure_streams
from runner.handon import publish_handoff
from runner.services import RunnerServices
from store import RunStatus
from tests.publisher.conftest import put_run
from tests.runner.conftest import Fleet


async def test_a_handoff_whose_publish_fails_says_so_on_the_run(fleet: Fleet) -> None:
    run = await put_run(fleet.store, status=RunStatus.QUEUED, attempt=2)
    await fleet.js.delete_stream(fleet.names.runs_stream)  # no stream takes the message
    svc = cast(RunnerServices, SimpleNamespace(publisher=fleet.publisher, store=fleet.store))
    try:
        await publish_handoff(svc, run)  # logged and said, never raised
    finally:
        await ensure_streams(fleet.js, fleet.names, fleet.wire)

    events = await fleet.store.read_events(run.run_id, after_seq=0, limit=100)
    (failed,) = [e for e in events if e.type == "run_publish_failed"]
    assert failed.attempt == 2
    assert failed.data["kind"] == "handoff" and failed.data["attempt"] == 2
    assert "stream" in failed.data["reason"]
    assert "sweeper republishes" in failed.data["next"]
    assert not [e for e in events if e.type == "run_queued"]
    assert (await fleet.store.get_run(run.run_id)).status is RunStatus.QUEUED
