"""The live view of `runfleet up`: runs by status, in flight, DLQ size, deliveries/s."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import click

from runner.embedded import EmbeddedFleet

ORDER = [
    "queued",
    "running",
    "paused_waiting_human",
    "paused_operator",
    "failed_resumable",
    "cancelled",
    "finished",
    "failed",
]


def render(snap: dict[str, object], rate: float, restarts: int) -> str:
    runs = snap["runs"]
    assert isinstance(runs, dict)
    parts = [f"{name}={runs[name]}" for name in ORDER if runs.get(name)]
    return (
        f"runs: {' '.join(parts) or 'none'} | in flight {snap['inflight']}"
        f" | dlq {snap['dlq']} | {rate:.1f} deliveries/s"
        f" | runners {snap['runners_alive']}" + (f" (restarts {restarts})" if restarts else "")
    )


async def live_view(fleet: EmbeddedFleet, *, interactive: bool) -> None:
    tty = interactive and sys.stderr.isatty()
    every = 1.0 if tty else 10.0
    last_total: float | None = None
    last_t = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            snap = await fleet.snapshot(session)
            now = time.monotonic()
            total = float(snap["deliveries"])  # type: ignore[arg-type]
            rate = 0.0 if last_total is None else max(total - last_total, 0) / (now - last_t)
            last_total, last_t = total, now
            line = render(snap, rate, sum(rp.restarts for rp in fleet.procs))
            if tty:
                click.echo(f"\r\x1b[2K{line}", err=True, nl=False)
            else:
                click.echo(line, err=True)
            await asyncio.sleep(every)
