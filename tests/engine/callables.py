"""Callables for the `call` nodes of the engine tests (`tests.engine.callables:<name>`).

State is keyed by run id, so tests never share it; tests import this module as
`tests.engine.callables` (the name the engine imports it by), so both see the same objects.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from engine.call_errors import Permanent, Transient
from engine.failures import FailureCode
from engine.nodes import CallContext

calls: Counter[str] = Counter()
"""How many times each run called `flaky` / `broken` (keyed by run id)."""


@dataclass
class Gate:
    """`entered` is set when the node starts; the node returns once `release` is set."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the call was cancelled while it waited (a cancel must reach the call)."""


_gates: dict[str, Gate] = {}


def gate(run_id: str) -> Gate:
    return _gates.setdefault(run_id, Gate())


async def wait_for_release(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    g = gate(ctx.run_id)
    g.entered.set()
    try:
        await g.release.wait()
    except asyncio.CancelledError:
        g.cancelled.set()
        raise
    return {"released": True}


async def flaky(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Raises `Transient` for the first `inputs["failures"]` calls of the run, then succeeds."""
    calls[ctx.run_id] += 1
    if calls[ctx.run_id] <= int(inputs["failures"]):
        raise Transient(FailureCode.RATE_LIMITED, f"call {calls[ctx.run_id]}: try again")
    return {"calls": calls[ctx.run_id]}


async def broken(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Always fails with a deterministic code."""
    calls[ctx.run_id] += 1
    raise Permanent(FailureCode.TOOL_FAILED_PERMANENT, "this input can never work")


async def permanent_rate_limited(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """`Permanent` with a code the failure table calls transient."""
    calls[ctx.run_id] += 1
    raise Permanent(FailureCode.RATE_LIMITED, "this key is revoked for good")


async def transient_bot_code(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """`Transient` with a bot code (not an engine code), failing the first call only."""
    calls[ctx.run_id] += 1
    if calls[ctx.run_id] == 1:
        raise Transient("QUOTA_HIT", "try later")
    return {"calls": calls[ctx.run_id]}
