"""Clocks and the lease (SPEC §5.4, §7.3), from a review of every clock the code reads.

A lease's `expires_at` is a wall-clock instant in the store, judged by every process on its own
wall clock. The holder must not believe it holds a lease longer than the others see it held:
a wall clock stepped back (NTP, a VM restored) made it do so, and two executions ran one run's
nodes at once. A sweeper whose clock ran ahead deleted a bank just uploaded under a live lease.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest

import engine.lease
from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.lease import LeaseKeeper
from engine.loader import LoadedWorkflow
from engine.outcome import CancelReason
from engine.scratch import bank_key, sweep_orphan_banks
from store import RunStore, utcnow
from store.blobs_fs import FilesystemBlobStore
from tests.engine.conftest import Claim

Load = Callable[[str], LoadedWorkflow]

STEP = timedelta(hours=1)


def keeper_from(
    store: RunStore, run_id: str, token: str, start: datetime, settings: EngineSettings
) -> LeaseKeeper:
    """A keeper of a lease claimed at `start` (on the clocks the test has patched)."""
    return LeaseKeeper(
        store, run_id, token, start + settings.lease_ttl, settings.lease_timing(), CancelSignal()
    )


def test_a_wall_clock_stepped_back_does_not_lengthen_the_lease_its_holder_believes_it_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timing = EngineSettings().lease_timing()  # TTL 30 s, margin 5 s
    keeper = LeaseKeeper(
        None,  # type: ignore[arg-type]  # no refresh here: only the holder's reading
        "r",
        "t",
        utcnow() + timing.ttl,
        timing,
        CancelSignal(),
    )
    assert 24 < keeper.seconds_left() <= 25

    real = engine.lease.utcnow
    monkeypatch.setattr(engine.lease, "utcnow", lambda: real() - STEP)  # NTP stepped back 1 h

    assert keeper.seconds_left() <= 25  # not 1 h 25 s: the others' clocks did not step


def test_a_wall_clock_stepped_forward_ends_the_lease_early_which_is_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timing = EngineSettings().lease_timing()
    keeper = LeaseKeeper(
        None,  # type: ignore[arg-type]
        "r",
        "t",
        utcnow() + timing.ttl,
        timing,
        CancelSignal(),
    )
    real = engine.lease.utcnow
    monkeypatch.setattr(engine.lease, "utcnow", lambda: real() + STEP)

    assert keeper.seconds_left() <= 0  # others may judge it expired: start nothing more


async def test_after_a_refresh_the_holder_believes_the_new_expiry_on_both_clocks(
    store: RunStore, claim: Claim, load: Load, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 s on, a refresh moves the lease to 50 s; then the wall clock steps back an hour. The
    holder believes 50 - 20 - 5 = 25 s left: the refresh moved its own reading too, and the
    step did not lengthen it."""
    settings = EngineSettings()
    run, token = await claim(load("gate"), settings=settings)
    assert run.lease is not None
    start, wall, own = utcnow(), [timedelta(0)], [0.0]
    monkeypatch.setattr(engine.lease, "utcnow", lambda: start + wall[0])
    monkeypatch.setattr(engine.lease, "held_clock", lambda: own[0])
    keeper = keeper_from(store, run.run_id, token, start, settings)
    wall[0], own[0] = timedelta(seconds=20), 20.0

    assert await keeper.refresh_once()
    wall[0] -= STEP

    stored = (await store.get_run(run.run_id)).lease
    assert stored is not None and stored.expires_at == start + timedelta(seconds=50)
    assert keeper.seconds_left() == pytest.approx(25.0)


async def test_a_refresh_after_the_wall_clock_was_stepped_gives_the_lease_up(
    store: RunStore, claim: Claim, load: Load, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepped back an hour, the wall clock would have the refresh write an expiry every other
    host reads as long past, while the holder, judging on its own clock too, believed it held
    the lease for a whole TTL more (a review of the first fix). A refresh that finds the wall
    clock moved against its own by more than the skew gives the lease up and writes nothing."""
    settings = EngineSettings()
    run, token = await claim(load("gate"), settings=settings)
    assert run.lease is not None
    cancel = CancelSignal()
    keeper = LeaseKeeper(
        store, run.run_id, token, run.lease.expires_at, settings.lease_timing(), cancel
    )
    real = engine.lease.utcnow
    monkeypatch.setattr(engine.lease, "utcnow", lambda: real() - STEP)

    assert not await keeper.refresh_once()

    assert cancel.reason is CancelReason.LEASE_LOST
    stored = (await store.get_run(run.run_id)).lease
    assert stored is not None and stored.expires_at == run.lease.expires_at


async def test_ntp_slewing_over_a_long_run_is_no_step(
    store: RunStore, claim: Claim, load: Load, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NTP slews a clock by up to 0.5 ms a second: over four hours, 7.2 s against the clock
    nobody sets, more than the skew. Refreshed every interval, the holder compares only what
    moved since its last refresh, so a slewed clock never reads as a step."""
    settings = EngineSettings()
    run, token = await claim(load("gate"), settings=settings)
    assert run.lease is not None
    start, elapsed = utcnow(), [0.0]
    slew = 0.0005
    monkeypatch.setattr(
        engine.lease, "utcnow", lambda: start + timedelta(seconds=elapsed[0] * (1 + slew))
    )
    monkeypatch.setattr(engine.lease, "held_clock", lambda: elapsed[0])
    keeper = keeper_from(store, run.run_id, token, start, settings)
    interval = settings.lease_interval.total_seconds()
    for _ in range(int(4 * 3600 / interval)):
        elapsed[0] += interval
        assert await keeper.refresh_once()


async def test_a_sweeper_whose_clock_runs_ahead_keeps_the_bank_of_the_lease_the_run_holds(
    store: RunStore, claim: Claim, load: Load, tmp_path: Path
) -> None:
    """The lease looks free to this sweeper (its clock is far ahead), and the execution's
    record of the bank it just uploaded has not landed yet: the bank under the run's lease
    token is kept; any other key of the run is an orphan and goes."""
    run, token = await claim(load("gate"))
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    current = bank_key(run.run_id, token)
    orphan = bank_key(run.run_id, "an-earlier-attempt")
    await blobs.put_bytes(current, b"just uploaded")
    await blobs.put_bytes(orphan, b"left by a writer that died")

    ahead = -timedelta(days=1)  # a negative skew: the lease reads long expired
    deleted = await sweep_orphan_banks(store, blobs, ahead)

    assert deleted == 1
    assert [info.key for info in await blobs.list(f"runs/{run.run_id}/scratch/")] == [current]
