"""The sweeper reaps staged uploads never promoted within `RUNFLEET_UPLOAD_TTL` (SPEC §8),
bytes before record, on the fleet's real store and filesystem blob store."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from runner.sweeper import Sweeper
from store import utcnow
from store.staging import StagingStore
from tests.runner.callables import idle_runner
from tests.runner.conftest import Fleet


async def test_sweeper_reaps_staged_uploads_older_than_the_upload_ttl_and_leaves_no_bytes(
    fleet: Fleet, tmp_path: Path
) -> None:
    staging = StagingStore(fleet.store, fleet.blobs)
    path = tmp_path / "a.txt"
    path.write_text("staged")
    old = await staging.stage("default", {"file": path})
    runner = await idle_runner(fleet, owner="sweeper-uploads")
    ttl = timedelta(hours=24)

    young = await Sweeper(runner.svc, upload_ttl=ttl).sweep_once(force=True)
    assert young.actions["upload_reaped"] == 0
    assert await fleet.store.get_staged_upload(old.id, "default") is not None

    later = utcnow() + ttl + timedelta(minutes=1)
    report = await Sweeper(runner.svc, upload_ttl=ttl, clock=lambda: later).sweep_once(force=True)

    assert report.actions["upload_reaped"] == 1
    assert await fleet.store.get_staged_upload(old.id, "default") is None
    assert await fleet.blobs.list("uploads/") == []
