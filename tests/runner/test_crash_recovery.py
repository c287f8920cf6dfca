"""A runner that dies without a word (SIGKILL) loses nothing: its lease lapses, JetStream
redelivers the message after `ack_wait` (= TTL + skew, SPEC §3, §5.4), and another runner adopts
the run (SPEC §5.3) and finishes it from the checkpoint — the node cut short re-runs (nodes are
at-least-once, SPEC §6.2), completed nodes never do (SPEC §13.6)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.deliveries import Delivery
from runner.delivery import handle
from store import CasConflict, Condition, RunDocument, RunStatus, Update
from store.sqlite import SqliteRunStore
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import (
    ledger,
    released,
    runner_process,
    sample,
    wait_for_ledger,
    workflow,
)
from tests.runner.test_fencing import (
    GatedStore,
    deliveries,
    host_a_runner,
    take_one_delivery,
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


class SilencedAfterClaim(GatedStore):
    """Runner A's store: every write after the claim hangs, as if A died right after claiming
    (before its first lease refresh, so before its first working ack)."""

    async def update_run(
        self, run_id: str, conditions: Sequence[Condition], update: Update, **kw: Any
    ) -> RunDocument | CasConflict:
        result = await super().update_run(run_id, conditions, update, **kw)
        if isinstance(result, RunDocument) and "lease" in update.set:
            self.shut()
        return result


async def test_a_claim_restarts_ack_wait_so_a_dead_owners_redelivery_finds_its_lease_free(
    fleet: Fleet, tmp_path: Path
) -> None:
    """JetStream counts `ack_wait` (= TTL + skew) from the delivery, the claim stamps
    `expires_at = now + TTL` with `now` taken when admission judged it. A runner slow to judge
    its delivery and dead before its first refresh would leave a redelivery that lands before
    the lease is free: the adopter would nak it for a whole lease interval (SPEC §5.2 step 5).
    The claim's working ack restarts `ack_wait`, so the redelivery comes after the lease is
    free and is adopted at once (docs/performance.md, recovery)."""
    book, release = tmp_path / "ledger", tmp_path / "release"
    release.touch()
    silenced = SilencedAfterClaim(await SqliteRunStore.open(fleet.tmp / "runs.db"))
    a = host_a_runner(fleet, silenced)
    a_delivery: asyncio.Task[None] | None = None
    try:
        await a.start()
        assert a.svc is not None
        fleet.runners.append(a)
        run = await fleet.launch(
            workflow("three_steps"), {"ledger": str(book), "release": str(release)}
        )
        msg = await take_one_delivery(fleet)
        # A is slow to judge its delivery: a third of the lease TTL passes before admission.
        await asyncio.sleep(fleet.engine.lease_timing().ttl.total_seconds() / 3)
        a_delivery = asyncio.ensure_future(
            handle(a.svc, Delivery.from_msg(msg, fleet.wire.max_deliver))
        )

        async def claimed() -> RunDocument | None:
            doc = await fleet.store.get_run(run.run_id)
            return doc if doc.lease is not None else None

        held = await eventually(claimed)
        assert held.lease is not None and held.lease.owner == "runner-a"
        lease_free_at = held.lease.expires_at + fleet.engine.lease_skew

        b = await fleet.start_runner()
        await fleet.wait_status(run.run_id, "finished", within=30)
        events = await fleet.store.read_events(run.run_id)
        adoption = next(e for e in events if e.type == "run_claimed")
        assert (adoption.data["path"], adoption.data["runner"]) == ("adoption", b.owner)
        assert adoption.at >= lease_free_at
        assert b.svc is not None
        naks = deliveries(b.svc.metrics).get(("nak", "redelivery_while_owner_lives"), 0)
        assert naks == 0, "the redelivery came while the dead owner's lease was still live"
    finally:
        if a_delivery is not None and not a_delivery.done():
            a_delivery.cancel()
            await asyncio.wait([a_delivery])
        await a.shutdown()
        await silenced.inner.close()
