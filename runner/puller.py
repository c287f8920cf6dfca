"""Pulling deliveries from the runs consumer: one JetStream pull request at a time, each of the
server's "no wait, with expiry" kind (ADR-0015).

Such a request waits up to its expiry for the first message; once it has delivered something,
the server hands over what else is ready (up to the batch) and ends the request with a `404 No
Messages` status. So a lone message reaches a runner as soon as it is published, and a backlog
still arrives in batches of the free slots.

Why not nats-py's `PullSubscription.fetch(batch, timeout)`: when its first, no-wait request
finds nothing it sends a second, plain one, and once that one has delivered a message the client
waits for the rest of the batch until the deadline. Measured with one message at a time
(`docs/performance.md`, "The fetch's tail"): 6 % of lone messages waited out the whole 0.5 s
fetch timeout with one consumer, and under a steady trickle each fetch held its first message
until the batch filled. That was the p99 of `bench.latency` at low and half load.

Each request gets its own reply subject (`<inbox>.<n>`), so a status that arrives late for a
request this puller has stopped waiting for cannot end a later one. Messages are never dropped,
whichever request they answer: they are real deliveries, and the next `fetch` returns them.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from publisher.errors import NatsRequestFailed

STATUS = "Status"
DESCRIPTION = "Description"
_ENDS_REQUEST = frozenset({"404", "408"})
"""No messages (after some or none), request expired: the request is over, nothing is wrong."""
_HEARTBEAT = "100"
_GRACE_S = 1.0
"""How long past the request's expiry the client waits for the server's closing status before
giving the request up (a connection that dropped it): the next request is a fresh one."""


class PullRefused(NatsRequestFailed, code="pull_refused"):
    """JetStream refused a pull request with a status other than "no messages" or "expired":
    `409` (consumer deleted, leadership change, too many waiting requests) or `503` (no
    responders: JetStream or the consumer is not there). The fetch loop waits and pulls again."""

    remedy = "check that the runs consumer exists (`runfleet streams ensure`) and JetStream is up"


class Puller:
    """Pulls a durable consumer's messages for one fetch loop (one request in flight)."""

    def __init__(self, nc: Client, stream: str, consumer: str) -> None:
        self._nc = nc
        self._subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = nc.new_inbox()
        """Each request is answered on `<inbox>.<n>`."""
        self._arrived: deque[Msg] = deque()
        self._wake = asyncio.Event()
        self._sub: Subscription | None = None
        self._request = 0

    async def subscribe(self) -> Puller:
        self._sub = await self._nc.subscribe(f"{self.inbox}.*", cb=self._on_msg)
        return self

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def nak_strays(self, delay: float) -> int:
        """Nak the deliveries that reached this puller and were never handed over (those of a
        request given up just before the fetch loop stopped), so they are redelivered after
        `delay` rather than after `ack_wait`; the count. Called once the puller is
        unsubscribed, when nothing more can arrive."""
        strays = self._take_stray(len(self._arrived))
        for msg in strays:
            await msg.nak(delay=delay)
        return len(strays)

    async def _on_msg(self, msg: Msg) -> None:
        self._arrived.append(msg)
        self._wake.set()

    async def fetch(self, batch: int, expires: float) -> list[Msg]:
        """Up to `batch` messages: what is ready now, else the first to arrive within
        `expires` seconds and whatever is ready with it. `[]` when nothing came. Raises
        `PullRefused` when JetStream refused the request and nothing was delivered."""
        if batch <= 0:
            raise ValueError("a pull asks for at least one message")
        if self._sub is None:
            await self.subscribe()
        got = self._take_stray(batch)
        if got:
            return got  # deliveries of an abandoned request: theirs to dispose of first
        self._request += 1
        reply = f"{self.inbox}.{self._request}"
        ask = {"batch": batch, "expires": int(expires * 1e9), "no_wait": True}
        await self._nc.publish(self._subject, json.dumps(ask).encode(), reply=reply)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + expires + _GRACE_S
        while len(got) < batch:
            if not self._arrived:
                self._wake.clear()
                left = give_up - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    break
                continue
            msg = self._arrived.popleft()
            status = _status(msg)
            if status is None:
                got.append(msg)
            elif msg.subject != reply or status == _HEARTBEAT:
                continue  # the closing status of a request given up earlier
            elif status in _ENDS_REQUEST or got:
                break
            else:
                headers = msg.headers or {}
                raise PullRefused(
                    f"JetStream refused the pull on {self._subject}: "
                    f"{status} {headers.get(DESCRIPTION, '')}".rstrip()
                )
        return got

    def _take_stray(self, batch: int) -> list[Msg]:
        """Messages already here, delivered to a request given up earlier (statuses dropped)."""
        got: list[Msg] = []
        while self._arrived and len(got) < batch:
            msg = self._arrived.popleft()
            if _status(msg) is None:
                got.append(msg)
        return got


def _status(msg: Msg) -> str | None:
    """The server's status, or None for a delivery. A delivery always carries its ack subject
    as its reply and a status never does; the header alone cannot tell them apart, because a
    published message may carry a header of its own named `Status`. Read from the header alone,
    such a run message was dropped as a stray status on every delivery, never acked, nak'd or
    recorded (found by review)."""
    if msg.reply:
        return None
    headers = msg.headers
    return headers.get(STATUS) if headers else None
