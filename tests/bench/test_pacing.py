"""`bench.pacing.open_loop`: every call starts on schedule, however long the earlier ones take."""

from __future__ import annotations

import asyncio

import pytest

from bench.pacing import open_loop


async def test_every_call_starts_while_earlier_ones_still_wait() -> None:
    release = asyncio.Event()
    started = 0

    async def call() -> None:
        nonlocal started
        started += 1
        if started == 10:
            release.set()  # the last one starts only if none of the earlier ones held it up
        await release.wait()

    assert await asyncio.wait_for(open_loop(1_000, 0.01, call), 10) == 10
    assert started == 10


async def test_a_failed_call_is_raised_after_every_call_ended() -> None:
    ended: list[int] = []

    async def call() -> None:
        index = len(ended)
        ended.append(index)
        if index == 0:
            raise ValueError("first call failed")
        await asyncio.sleep(0)

    with pytest.raises(ValueError, match="first call failed"):
        await open_loop(1_000, 0.005, call)
    assert len(ended) == 5


def test_at_least_one_call() -> None:
    calls: list[None] = []

    async def call() -> None:
        calls.append(None)

    assert asyncio.run(open_loop(1.0, 0.0, call)) == 1 and calls == [None]
