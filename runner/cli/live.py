"""The live view of `runfleet up`: runs by status, in flight, DLQ size, deliveries/s, and a
row per runner (pid, HTTP port, slots in use, runs in flight, restarts)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

import aiohttp
import click

from runner.embedded import EmbeddedFleet, RunnerRow

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
        f" | dlq {_count(snap['dlq'])} | {rate:.1f} deliveries/s"
        f" | runners {snap['runners_alive']}" + (f" (restarts {restarts})" if restarts else "")
    )


def _count(n: object) -> str:
    """A count the fleet could not read (NATS down) is `?`, never a negative number."""
    return "?" if not isinstance(n, int) or n < 0 else str(n)


def runner_line(row: RunnerRow) -> str:
    """`runner 0  pid 4242  http :38211  slots 1/8 in use  runs in flight 1`."""
    if row.pid is None and row.last_exit:
        # Why it is down and when it comes back: `up`'s log has the rest of the error.
        when = "restarting" if row.restart_in_s is None else f"restart in {row.restart_in_s:.0f}s"
        restarts = f", restarts {row.restarts}" if row.restarts else ""
        return f"  runner {row.index}  not running: {row.last_exit} ({when}{restarts})"
    pid = f"pid {row.pid}" if row.pid is not None else "not running"
    port = f"http :{row.http_port}" if row.http_port is not None else "http (starting)"
    if row.answering:
        load = f"slots {row.slots_in_use}/{row.slots} in use  runs in flight {row.runs_in_flight}"
    else:
        load = "not answering"
    last = f", last: {row.last_exit}" if row.last_exit else ""
    restarts = f"  (restarts {row.restarts}{last})" if row.restarts else ""
    return f"  runner {row.index}  {pid}  {port}  {load}{restarts}"


def render_lines(snap: dict[str, object], rate: float, restarts: int) -> list[str]:
    rows = snap.get("runners") or []
    assert isinstance(rows, list)
    nats = line.splitlines() if isinstance(line := snap.get("nats"), str) else []
    return [render(snap, rate, restarts), *nats, *(runner_line(r) for r in rows)]


async def live_view(fleet: EmbeddedFleet, *, interactive: bool, notes: Sequence[str] = ()) -> None:
    """Redraw the fleet's lines every second on a terminal (every 10 s otherwise), followed by
    `notes` (the console's URL, once it listens)."""
    tty = interactive and sys.stderr.isatty()
    every = 1.0 if tty else 10.0
    last_total: float | None = None
    last_t = time.monotonic()
    drawn = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            snap = await fleet.snapshot(session)
            now = time.monotonic()
            total = float(snap["deliveries"])  # type: ignore[arg-type]
            rate = 0.0 if last_total is None else max(total - last_total, 0) / (now - last_t)
            last_total, last_t = total, now
            lines = [*render_lines(snap, rate, sum(rp.restarts for rp in fleet.procs)), *notes]
            if tty:
                # Redraw the block in place: up to its first line, then clear each line.
                up = f"\x1b[{drawn}F" if drawn else "\r"
                click.echo(up + "\n".join(f"\x1b[2K{ln}" for ln in lines), err=True)
                drawn = len(lines)
            else:
                click.echo("\n".join(lines), err=True)
            await asyncio.sleep(every)
