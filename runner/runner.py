"""`Runner`: one process's consume loop and its companions (SPEC §5.1, §5.8, ADR-0007).

Shape (after temporal's `Worker._run`): one task per sub-loop — fetch, sweeper, backstop, the
HTTP endpoints — then wait for the first failure or a stop, and shut down in order: stop
fetching → drain the in-flight executions (each hands off, SPEC §5.6) → cancel the loops →
drain the NATS connection. `shutdown()` is idempotent; `async with Runner(...)` works; signal
handling lives only in `runfleet runner`'s entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError, ServiceUnavailableError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from engine.config import EngineSettings
from engine.local import owner_name
from engine.outcome import CancelReason
from engine.sandbox.protocols import SandboxDriver
from publisher.config import WireSettings
from publisher.connection import connect
from publisher.dlq import DlqStore
from publisher.errors import ConsumerMismatch, StreamNotFound
from publisher.publisher import Publisher
from publisher.wire import WireNames
from runner.backstop import Backstop
from runner.build import describe
from runner.config import RunnerSettings
from runner.deliveries import Delivery
from runner.delivery import handle
from runner.health import HealthServer
from runner.metrics import RunnerMetrics
from runner.puller import Puller, PullRefused
from runner.services import RunnerServices
from runner.supervisor import TaskGroup
from runner.sweeper import Sweeper
from store import BlobStore, RunStore, StoreError

log = logging.getLogger(__name__)


def gather_wait(delivered: int, asked: int, gather: float) -> float:
    """How long the fetch loop lets messages gather before its next pull (ADR-0015 amendment 2).

    Only after a pull that delivered something and emptied the queue (fewer than it asked
    for). Under a trickle the next pull would otherwise fetch one message, and each run would
    claim and commit alone; letting the next few gather costs a run at most `gather` and lets
    them share a loop turn and a commit. A backlog (a full pull) never waits: its slots are
    what bounds it. An idle queue (an empty pull) never waits: the next lone run is handed over
    as it arrives, so latency at low load is unchanged."""
    return gather if 0 < delivered < asked else 0.0


class Runner:
    def __init__(
        self,
        *,
        store: RunStore,
        driver: SandboxDriver,
        data_dir: Path,
        blobs: BlobStore | None = None,
        settings: RunnerSettings | None = None,
        engine: EngineSettings | None = None,
        wire: WireSettings | None = None,
        owner: str | None = None,
        consume: bool = True,
    ) -> None:
        self.store = store
        self.driver = driver
        self.data_dir = data_dir
        self.blobs = blobs
        self.settings = settings or RunnerSettings()
        self.engine = engine or EngineSettings()
        self.wire = wire or WireSettings()
        self.owner = owner or owner_name()
        self.names = WireNames(self.wire.namespace)
        self.consume = consume
        self.metrics = RunnerMetrics()
        self.svc: RunnerServices | None = None
        self.http: HealthServer | None = None
        self._nc: Client | None = None
        self._tasks: TaskGroup | None = None
        self._stop_fetching = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stopped = asyncio.Event()
        self._shutdown_started = False
        self._pull_subs: list[Puller | JetStreamContext.PullSubscription] = []
        self.last_progress = time.monotonic()
        self._ack_pending_read = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Runner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        nc, js = await connect(self.wire, name=f"runfleet-runner-{self.owner}")
        self._nc = nc
        try:
            await self._start_on(nc, js)
        except BaseException:
            # The connection and the driver's API client, closed: a start that fails anywhere
            # (a health port in use too) leaves nothing open.
            await self.shutdown()
            raise

    async def _start_on(self, nc: Client, js: JetStreamContext) -> None:
        await self._check_consumer(js)
        preflight = getattr(self.driver, "preflight", None)  # may it start sandboxes? (k8s)
        if preflight is not None:
            await preflight()
        dlq = DlqStore(js, self.names, self.blobs)
        self.svc = RunnerServices(
            store=self.store,
            blobs=self.blobs,
            nc=nc,
            js=js,
            names=self.names,
            wire=self.wire,
            engine=self.engine,
            settings=self.settings,
            driver=self.driver,
            metrics=self.metrics,
            publisher=Publisher(
                store=self.store, nc=nc, js=js, settings=self.wire, names=self.names, dlq=dlq
            ),
            dlq=dlq,
            data_dir=self.data_dir,
            owner=self.owner,
        )
        self._tasks = TaskGroup()
        await nc.subscribe(self.names.control_subject("*"), cb=self._on_control)
        self.http = HealthServer(self)
        await self.http.start(self.settings.http_host, self.settings.http_port)
        if self.consume:
            puller = Puller(nc, self.names.runs_stream, self.names.consumer)
            self._pull_subs.append(await puller.subscribe())
            self._tasks.spawn(self._fetch_loop(puller), name="loop:fetch", critical=True)
        if self.settings.sweeper:
            sweeper = Sweeper(self.svc)
            self._tasks.spawn(sweeper.loop(), name="loop:sweeper", critical=True)
        if self.settings.backstop:
            backstop = Backstop(self.svc)
            self._pull_subs.append(await backstop.subscribe())
            self._tasks.spawn(backstop.loop(), name="loop:backstop", critical=True)
        # The one start line, with the wording `up`, the soak and the benches wait for.
        log.info("runner %s: runfleet %s", self.owner, describe())
        # The ready line, last and whole: `up`, the tests and the benchmarks read the port
        # from its end.
        log.info("runner %s: %d slots, http :%s", self.owner, self.settings.slots, self.http.port)

    async def run(self) -> None:
        """Run until `shutdown()` (or a crashed loop, which is re-raised after shutdown)."""
        if self._tasks is None:
            await self.start()
        assert self._tasks is not None
        failure = asyncio.ensure_future(self._tasks.first_failure())
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({failure, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if failure.done() and failure.exception() is not None:
            await self.shutdown()
            raise failure.exception()  # type: ignore[misc]
        failure.cancel()

    async def shutdown(self) -> None:
        """Stop fetching, hand off in-flight executions (drain), stop the loops, drain NATS.

        Fetching stops *before* any execution is cancelled: a draining runner must not fetch the
        handoff message it is about to publish (the next runner's first delivery of the new
        attempt has to be a first delivery, SPEC §5.6)."""
        if self._shutdown_started:
            await self._stopped.wait()
            return
        self._shutdown_started = True
        self._stop_fetching.set()
        try:
            if self.svc is not None:
                self.svc.draining = True  # anything still fetched is nak'd (1 s)
            if self._tasks is not None:
                self._tasks.closing = True
                fetch = self._tasks.named("loop:fetch")
                if fetch:
                    grace = self.settings.fetch_timeout.total_seconds() + 5.0
                    await asyncio.wait(fetch, timeout=grace)
            await self._unsubscribe_pulls()
            if self.svc is not None:
                # The log says what a stop did (found by an operator walkthrough: a drained
                # runner's log ended at its start line).
                handing = list(self.svc.executions)
                log.info(
                    "runner %s draining: %d run(s) to hand off%s",
                    self.owner,
                    len(handing),
                    f" ({', '.join(handing[:10])}{', ...' if len(handing) > 10 else ''})"
                    if handing
                    else "",
                )
                for cancel in list(self.svc.executions.values()):
                    cancel.cancel(CancelReason.DRAIN)
            if self._tasks is not None:
                deliveries = self._tasks.named("delivery:")
                if deliveries:
                    ceiling = self.engine.unwind_ceiling.total_seconds()
                    await asyncio.wait(deliveries, timeout=ceiling)
                await self._tasks.cancel_all(grace_s=5.0)
            if self.http is not None:
                await self.http.stop()
            if self._nc is not None and not self._nc.is_closed:
                await self._unsubscribe_pulls()
                with contextlib.suppress(Exception):
                    await self._nc.drain()
            close = getattr(self.driver, "close", None)  # a driver's API client (kubernetes)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        finally:
            self._stopped.set()
            log.info("runner %s stopped", self.owner)

    async def _unsubscribe_pulls(self) -> None:
        """A pull subscription never drains by itself (nats-py waits out the whole drain
        timeout), and an unsubscribed one receives no more messages: drop them first."""
        subs, self._pull_subs = self._pull_subs, []
        for psub in subs:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            if isinstance(psub, Puller):
                with contextlib.suppress(Exception):  # not nak'd: redelivered after ack_wait
                    await psub.nak_strays(self.settings.drain_nak_delay.total_seconds())

    # -- loops -------------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._tasks.named("delivery:")) if self._tasks else 0

    async def _fetch_loop(self, puller: Puller) -> None:
        assert self.svc is not None and self._tasks is not None
        timeout = self.settings.fetch_timeout.total_seconds()
        gather = self.settings.fetch_gather.total_seconds()
        while not self._stop_fetching.is_set():
            self.last_progress = time.monotonic()
            if time.monotonic() - self._ack_pending_read > 5.0:
                # Here, not after a fetch: a runner whose slots stay full fetches nothing, and
                # its gauges held a stale read (an autoscaling walkthrough).
                await self._read_ack_pending()
            free = self.settings.slots - self.inflight
            self.metrics.free_slots.set(free)
            if free <= 0:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), timeout)
                continue
            try:
                msgs = await puller.fetch(free, timeout)
            except nats.errors.ConnectionClosedError:
                if self._stop_fetching.is_set():
                    return
                raise
            except (nats.errors.Error, PullRefused) as exc:
                log.warning("fetch failed (%r); retrying", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_fetching.wait(), timeout)
                continue
            for msg in msgs:
                self._dispatch(msg)
            if msgs:
                self.metrics.fetched.observe(len(msgs))
            wait = gather_wait(len(msgs), free, gather)
            if wait:
                await asyncio.sleep(wait)

    async def _read_ack_pending(self) -> None:
        """`num_ack_pending` and `num_pending` for the metrics (a cheap consumer-info read every
        few seconds)."""
        self._ack_pending_read = time.monotonic()
        assert self.svc is not None
        try:
            info = await self.svc.js.consumer_info(self.names.runs_stream, self.names.consumer)
        except (nats.errors.Error, TimeoutError):
            return
        self.metrics.ack_pending.set(info.num_ack_pending or 0)
        self.metrics.num_pending.set(info.num_pending or 0)

    def _dispatch(self, msg: Msg) -> None:
        assert self.svc is not None and self._tasks is not None
        delivery = Delivery.from_msg(msg, self.wire.max_deliver)
        task = self._tasks.spawn(
            handle(self.svc, delivery),
            name=f"delivery:{delivery.info.stream_seq}",
            critical=False,
        )
        task.add_done_callback(lambda _t: self._slot_freed.set())

    async def _on_control(self, msg: Msg) -> None:
        """A cancel signal is an accelerator only: act on it when the run document agrees
        (the refresh read would see the same flag a beat later)."""
        assert self.svc is not None
        run_id = msg.subject.rsplit(".", 1)[-1]
        cancel = self.svc.executions.get(run_id)
        if cancel is None:
            return
        try:
            run = await self.store.get_run(run_id)
        except StoreError:
            return
        if run.cancel_requested:
            cancel.cancel(CancelReason.OPERATOR)

    async def _check_consumer(self, js: JetStreamContext) -> None:
        try:
            info = await self._consumer_info(js)
        except NotFoundError:
            raise StreamNotFound(
                f"no consumer {self.names.consumer} on stream {self.names.runs_stream}"
            ) from None
        want_wait = self.wire.effective_ack_wait.total_seconds()
        cfg = info.config
        problems: list[str] = []
        if cfg.max_deliver != self.wire.max_deliver:
            here = self.wire.max_deliver
            problems.append(f"max_deliver {cfg.max_deliver} (RUNFLEET_MAX_DELIVER here: {here})")
        if cfg.ack_wait is None or abs(float(cfg.ack_wait) - want_wait) > 0.01:
            problems.append(
                f"ack_wait {cfg.ack_wait}s (RUNFLEET_ACK_WAIT, default RUNFLEET_LEASE_TTL +"
                f" RUNFLEET_LEASE_SKEW, here: {want_wait}s)"
            )
        if problems:
            raise ConsumerMismatch(
                f"consumer {self.names.consumer} has {'; '.join(problems)}: the settings here"
                " contradict the fleet's (SPEC §3)"
            )

    async def _consumer_info(self, js: JetStreamContext) -> ConsumerInfo:
        """The consumer's info, waiting out a leader election: on a cluster a consumer whose
        leader just died answers nothing (or 503) for a few seconds (docs/deploy.md), and a
        runner started in that window must not exit for it. Bounded by the start-up budget."""
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(self.settings.consumer_wait.total_seconds()),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception_type(
                (nats.errors.TimeoutError, TimeoutError, ServiceUnavailableError)
            ),
            reraise=True,
        ):
            with attempt:
                info: ConsumerInfo = await js.consumer_info(
                    self.names.runs_stream, self.names.consumer
                )
                return info
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def health(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "inflight": self.inflight,
            "slots": self.settings.slots,
            "draining": bool(self.svc and self.svc.draining),
            "since_progress_s": round(time.monotonic() - self.last_progress, 3),
        }
