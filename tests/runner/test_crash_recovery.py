"""A runner that dies without a word (SIGKILL) loses nothing: its lease lapses, JetStream
redelivers the message after `ack_wait` (= TTL + skew, SPEC §3, §5.4), and another runner adopts
the run (SPEC §5.3) and finishes it from the checkpoint — the node cut short re-runs (nodes are
at-least-once, SPEC §6.2), completed nodes never do (SPEC §13.6)."""

from __future__ import annotations

import signal
from pathlib import Path

from store import RunStatus
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import (
    ledger,
    released,
    runner_process,
    sample,
    wait_for_ledger,
    workflow,
)


async def test_sigkill_mid_run_another_runner_adopts_after_the_lease_lapses_and_finishes_from_the_checkpoint(  # noqa: E501
    fleet: Fleet, tmp_path: Path
) -> None:
    book, release = tmp_path / "ledger", tmp_path / "release"
    async with runner_process(fleet, "runner-a") as a:
        run = await fleet.launch(
            workflow("three_steps"), {"ledger": str(book), "release": str(release)}
        )
        await wait_for_ledger(book, "two")
        a.signal(signal.SIGKILL)
        assert await a.wait_exit(10) == -signal.SIGKILL

    crashed = await fleet.store.get_run(run.run_id)
    assert crashed.status is RunStatus.RUNNING
    assert crashed.lease is not None and crashed.lease.owner == a.owner
    assert crashed.checkpoint is not None and crashed.checkpoint.completed == ["one"]
    lease_free_at = crashed.lease.expires_at + fleet.engine.lease_skew

    release.touch()  # the re-run of `two` may now complete
    b = await fleet.start_runner()
    await fleet.wait_status(run.run_id, "finished", within=30)
    done = await eventually(released(fleet, run.run_id))

    assert ledger(book) == {"one": 1, "two": 2, "three": 1}
    assert done.attempt == 1  # an adoption continues the same attempt
    assert done.lease is None
    assert done.checkpoint is not None and done.checkpoint.completed == ["one", "two", "three"]
    events = await fleet.store.read_events(run.run_id)
    claims = [e for e in events if e.type == "run_claimed"]
    assert [(c.data["path"], c.data["runner"]) for c in claims] == [
        ("fresh", a.owner),
        ("adoption", b.owner),
    ]
    adopted = claims[1]
    assert adopted.at >= lease_free_at, "adopted before the dead runner's lease was free"
    after = [e.type for e in events if e.seq > adopted.seq]
    assert after[0] == "run_workspace_reset"
    assert after[-1] == "run_finished"
    assert [e.data["node"] for e in events if e.seq > adopted.seq and e.type == "node_started"] == [
        "two",
        "three",
    ]
    assert sample(b, "runfleet_claims_total", path="adoption", outcome="won") == 1
    assert await fleet.queue_drained()
