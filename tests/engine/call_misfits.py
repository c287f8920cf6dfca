"""Callables that misbehave, for `tests/engine/test_call_misfits.py`
(`tests.engine.call_misfits:<name>`): what a walkthrough of a call-node author found."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import time
from typing import Any

from engine.call_errors import Permanent
from engine.nodes import CallContext

NOT_CALLABLE = 42


def blocks(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """A plain function with blocking code, as a synchronous client would be."""
    time.sleep(float(inputs["seconds"]))
    return {"slept": True}


async def swallows_cancel(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Catches the cancellation its timeout sends and carries on."""
    end = time.monotonic() + float(inputs["seconds"])
    while time.monotonic() < end:
        with contextlib.suppress(asyncio.CancelledError):  # the misbehaviour under test
            await asyncio.sleep(0.05)
    return {"late": True}


async def exits(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    sys.exit(3)


async def raises_cancelled(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    raise asyncio.CancelledError


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


async def unprintable(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    raise Unprintable


async def returns_object(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"when": object()}


async def returns_nan(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"x": float("nan")}


async def mutates_context(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    ctx.outputs["first"]["n"] = 999  # type: ignore[index]
    ctx.vars["who"] = "Mallory"  # type: ignore[index]
    return {"mutated": True}


async def reports_nan(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    ctx.report_cost(float("nan"))
    return {}


async def claims_code(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    raise Permanent(inputs["code"], "says so")


async def wrong_arity(ctx: CallContext) -> dict[str, Any]:
    return {}


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")
"""A context variable the caller set (a tracing span, a request id)."""


def reads_context(ctx: CallContext, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"request_id": REQUEST_ID.get()}
