"""Actors: product coroutines that stop before every I/O operation.

Every product coroutine the machine starts (a delivery, an operator call, a backstop or sweeper
pass) runs as an `Actor`; the doubles of `doubles.py` call `gate` before each store, broker and
DLQ operation, and the actor waits there until the machine grants it that one operation. The
actor running now is `ACTOR` (a context variable: the tasks an actor spawns inherit it)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.cancel import CancelSignal
from engine.outcome import Outcome
from runner.deliveries import Delivery
from runner.services import RunnerServices
from store import RunDocument

if TYPE_CHECKING:
    from tests.model.doubles import ModelLeaseKeeper

ACTOR: contextvars.ContextVar[Actor | None] = contextvars.ContextVar("model_actor", default=None)


class Actor:
    """One product coroutine (a delivery, an operator call, a backstop or sweeper pass). It
    runs only when granted, one store / broker / DLQ operation per grant; the tasks it spawns
    (`wait_for`, `_race`) inherit it through the context."""

    def __init__(self, name: str, kind: str, runner: int | None = None) -> None:
        self.name = name
        self.kind = kind
        self.runner = runner
        self.label = "start"
        self.task: asyncio.Task[Any] | None = None
        self.changed = asyncio.Event()
        self.waiting: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.verdict: str | None = None
        self.delivery: Delivery | None = None
        self.live: Live | None = None
        self.reads: dict[str, RunDocument] = {}
        self.on_done: Callable[[], None] | None = None
        self.svc: RunnerServices | None = None
        self.faults: set[str] = set()
        """The points at which a fault the machine armed hit this actor."""
        self.hostile = False
        """A backstop settling a hostile advisory: its error log about it is expected."""
        self.crashed = False

    def start(self, coro: Coroutine[Any, Any, Any]) -> None:
        ctx = contextvars.copy_context()
        ctx.run(ACTOR.set, self)
        self.task = asyncio.get_running_loop().create_task(self._main(coro), context=ctx)

    async def _main(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded and judged by the machine
            self.error = exc
        finally:
            self.changed.set()

    async def gate(self, label: str) -> None:
        if self.crashed:
            # A crash is the process dying: a `finally` or `except BaseException` that tries
            # one more operation (say `_park` withdrawing its record) does not get to do it.
            raise asyncio.CancelledError
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting, self.label = fut, label
        self.changed.set()
        try:
            await fut
        finally:
            self.waiting = None

    @property
    def parked(self) -> bool:
        return self.waiting is not None and not self.waiting.done()

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def grant(self) -> None:
        assert self.waiting is not None
        self.changed.clear()
        self.waiting.set_result(None)


async def gate(label: str) -> None:
    actor = ACTOR.get()
    if actor is not None:
        await actor.gate(label)


@dataclass
class Live:
    """An execution the machine knows of: its lease keeper is the machine's to beat."""

    actor: Actor
    runner: int
    token: str
    keeper: ModelLeaseKeeper
    delivery: Delivery
    keeper_alive: bool = True
    ended: bool = False
    outcome: Outcome | None = None

    @property
    def cancel(self) -> CancelSignal:
        return self.keeper.cancel


@dataclass
class AdvisoryState:
    """One MAX_DELIVERIES advisory on the backstop's durable consumer."""

    seq: int
    available_at: float
    inflight: bool = False
    done: bool = False
    data: bytes | None = None
    """A hostile advisory's own bytes (it names no sequence the backstop may act on)."""
