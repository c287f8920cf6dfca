"""A run's events as server-sent events (SPEC v2.2 §10c: "a following SSE stream"), over the
same `event_batches(follow=True)` as `runfleet events --follow`.

Each event is an SSE `message` whose `id` is its seq, so a client that reconnects with
`Last-Event-ID` continues after it; then one `end` whose data is the run as it stopped moving
(settled, or waiting for a person or an operator). A failure once the stream has begun is an
`error` event with the usual error body. While nothing happens (a long node), a comment line
goes out every `KEEPALIVE_S`, so proxies and load balancers do not drop a quiet stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from aiohttp import web

from runner import operations as ops
from runner.console.models import MAX_SEQ, EventOut, RunOut
from runner.console.routing import Call, bearer_still_holds, owned_run
from store import Event, RunfleetError

KEEPALIVE_S = 15.0
RECHECK_S = 1.0
"""How often an open stream looks whether its token still holds (`bearer_still_holds`)."""
KEEPALIVE = b": keep-alive\n\n"
_ASCII_DIGITS = re.compile(f"[0-9]{{1,{len(str(MAX_SEQ))}}}")

T = TypeVar("T")


def frame(data: str, event: str | None = None, event_id: int | None = None) -> bytes:
    head = (f"id: {event_id}\n" if event_id is not None else "") + (
        f"event: {event}\n" if event else ""
    )
    return f"{head}data: {data}\n\n".encode()


async def with_heartbeat(source: AsyncIterator[T], every: float) -> AsyncGenerator[T | None, None]:
    """`source`'s items, and None whenever `every` seconds pass without one. The pending read
    is never cancelled by a beat (cancelling it would end `source`), only when the consumer
    leaves."""
    try:
        while True:
            step = asyncio.ensure_future(anext(source))
            try:
                while not step.done():
                    done, _ = await asyncio.wait({step}, timeout=every)
                    if not done:
                        yield None
            finally:
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await step
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


def start_after(call: Call) -> int:
    after = call.query_int("after", 0, 0, MAX_SEQ)
    last_id = call.request.headers.get("Last-Event-ID", "")
    # ASCII digits only (`str.isdigit` also takes '²'), and no longer than MAX_SEQ's: anything
    # else is not an id this stream sent, and reads as absent.
    if _ASCII_DIGITS.fullmatch(last_id) and int(last_id) <= MAX_SEQ:
        after = max(after, int(last_id))
    return after


REVOKED = {
    "code": "unauthorized",
    "message": "the token no longer holds (revoked, or given another tenant or role)",
    "remedy": "open the stream again with a token of RUNFLEET_API_TOKENS",
}


async def _send_events(
    call: Call, response: web.StreamResponse, batches: AsyncIterator[list[Event]]
) -> bool:
    """Every event until the run settles (True), or until the token stops holding (False)."""
    quiet = 0.0
    async with contextlib.aclosing(with_heartbeat(batches, RECHECK_S)) as beats:
        async for batch in beats:
            if not bearer_still_holds(call.request):
                return False
            if batch is None:
                quiet += RECHECK_S
                if quiet >= KEEPALIVE_S:
                    await response.write(KEEPALIVE)
                    quiet = 0.0
                continue
            quiet = 0.0
            for event in batch:
                await response.write(frame(EventOut.of(event).model_dump_json(), None, event.seq))
    return True


async def stream(call: Call) -> web.StreamResponse:
    doc = await owned_run(call, call.path("run_id"))
    after = start_after(call)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(call.request)
    batches = ops.event_batches(call.env, doc.run_id, after=after, follow=True)
    try:
        try:
            if await _send_events(call, response, batches):
                final = RunOut.of(await ops.get_run(call.env, doc.run_id))
                await response.write(frame(final.model_dump_json(), "end"))
            else:
                await response.write(frame(json.dumps({"error": REVOKED}), "error"))
        except RunfleetError as exc:
            await response.write(frame(json.dumps({"error": exc.to_dict()}), "error"))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left: nothing to tell it
    return response
