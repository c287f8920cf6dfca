"""The chaos: `Faults` breaks the fleet on purpose: runner SIGKILLs at a steady beat
(`killer`), and on a plan keyed to the runs finished (`plan`, `chaos`) drains, a NATS outage,
cluster server faults (`tests/soak_cluster.py`), store faults (one caught on a `finished` status
write through the seam) and poison on the work subject. Each fault leaves its trace (a
runner's end, a server or store fault's window), so the checks can tell a re-run it explains
from a product bug; what each one breaks and what saves it is in the package's docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import signal
import sqlite3
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

from engine.local import new_run_id
from publisher.wire import RunMessage, encode
from store import RunDocument, RunStatus, StoreError, utcnow
from tests.soak.config import POST_ENGINE_CATCH_S, TENANT, UNWIND_CEILING_S
from tests.soak.fleet import Drain, Fleet, RunnerProc, Window
from tests.soak.reads import _events, _list
from tests.soak_cluster import KINDS, ClusterFaults
from tests.soak_hostile import hostile_bodies
from tests.support.nats_cluster import Cluster


class Faults(Fleet):
    """Every fault the soak injects."""

    async def killer(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(self.cfg.kill_every * self.rng.uniform(0.6, 1.4))
            if self.cfg.max_kills is not None and self.report.kills >= self.cfg.max_kills:
                return
            if self.nats_down:
                continue
            candidates = self.eligible()
            if not candidates:
                continue
            rp = self.rng.choice(candidates)
            rp.expected_exit = "killed"
            rp.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(rp.proc.wait)
            self.mark_ended(rp, "killed")
            self.report.kills += 1
            self.say(f"SIGKILL runner {rp.index} ({rp.owner}); kill #{self.report.kills}")
            self.respawn(rp.index)

    def plan(self) -> list[tuple[float, str]]:
        steps: list[tuple[float, str]] = [(0.02, "poison"), (0.5, "poison")]
        for i in range(self.cfg.drains):
            steps.append((0.1 + 0.5 * i / self.cfg.drains, "drain"))
        for i in range(self.cfg.nats_restarts):
            steps.append((0.3 + 0.4 * i / self.cfg.nats_restarts, "nats"))
        if self.cfg.nats_cluster > 1:
            for i in range(self.cfg.leader_kills):
                steps.append((0.35 + 0.4 * i / self.cfg.leader_kills, "kill_stream_leader"))
            for i, kind in enumerate(self.cluster_faults().plan(self.cfg.server_faults)):
                steps.append((0.05 + 0.85 * i / self.cfg.server_faults, kind))
        for i in range(self.cfg.store_faults):
            steps.append((0.55 + 0.25 * i / self.cfg.store_faults, "store"))
        for i in range(self.cfg.post_engine_store_faults):
            steps.append((0.4 + 0.3 * i / self.cfg.post_engine_store_faults, "post_engine"))
        return sorted(steps)

    async def chaos(self) -> None:
        try:
            for fraction, kind in self.plan():
                await self.until(
                    functools.partial(self.finished_at_least, int(fraction * self.cfg.runs))
                )
                self.say(f"chaos: {kind} (finished {self.finished})")
                if kind == "poison":
                    await self.send_poison()
                elif kind == "drain":
                    await self.drain_until_a_handoff()
                elif kind == "nats":
                    await self.nats_outage()
                elif kind in KINDS:
                    await self.server_fault(kind)
                elif kind == "store":
                    await self.store_fault()
                elif kind == "post_engine":
                    await self.post_engine_store_fault()
        finally:
            self.chaos_done.set()

    async def busiest(self, within: float) -> tuple[RunnerProc | None, list[RunDocument]]:
        """The runner holding the most live leases on runs at the `work` node."""
        assert self.reader is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                running = await _list(self.reader, [RunStatus.RUNNING])
                now = utcnow()
                held: dict[str, list[RunDocument]] = defaultdict(list)
                for run in running:
                    cp = run.checkpoint
                    if (
                        run.lease is not None
                        and run.lease.expires_at > now
                        and cp is not None
                        and cp.restart_node == "work"
                    ):
                        held[run.lease.owner].append(run)
                live = {rp.owner: rp for rp in self.eligible()}
                best = max((o for o in held if o in live), key=lambda o: len(held[o]), default=None)
                if best is not None:
                    return live[best], held[best]
            await asyncio.sleep(0.1)
        candidates = self.eligible()
        return (self.rng.choice(candidates) if candidates else None), []

    async def drain(
        self, *, outage: bool, target: tuple[RunnerProc | None, list[RunDocument]] | None = None
    ) -> None:
        rp, held = target or await self.busiest(within=30)
        if rp is None:
            self.report.violations.append("drain: no live runner to drain")
            return
        self.protected.add(rp.index)
        drain = Drain(
            owner=rp.owner,
            outage=outage,
            held={r.run_id: r.attempt for r in held},
            tokens={r.run_id: r.lease.token for r in held if r.lease is not None},
            sent_at=time.time(),
        )
        self.drain_log.append(drain)
        self.report.drains += 1
        self.report.drain_held.append((outage, len(held)))
        rp.expected_exit = "drained"
        self.say(
            f"SIGTERM runner {rp.index} ({rp.owner}) holding {len(held)} runs at `work`"
            + (" during the NATS outage" if outage else "")
        )
        sent = time.monotonic()
        rp.proc.send_signal(signal.SIGTERM)
        limit = UNWIND_CEILING_S + 30.0
        try:
            drain.exit_code = await asyncio.to_thread(rp.proc.wait, limit)
        except subprocess.TimeoutExpired:
            rp.proc.kill()
            await asyncio.to_thread(rp.proc.wait)
            self.report.violations.append(
                f"drained runner {rp.owner} still alive {limit:.0f}s after SIGTERM; killed"
                f" (log {rp.log_path})"
            )
        drain.took_s = time.monotonic() - sent
        self.mark_ended(rp, "drained")
        self.say(f"runner {rp.index} drained: exit {drain.exit_code} in {drain.took_s:.1f}s")
        if drain.exit_code not in (0, None):
            self.report.violations.append(
                f"drained runner {rp.owner} exited {drain.exit_code}, not 0: {rp.cause()}"
                f" (log {rp.log_path})"
            )
        elif drain.took_s > UNWIND_CEILING_S:
            self.report.violations.append(
                f"drained runner {rp.owner} took {drain.took_s:.1f}s (ceiling {UNWIND_CEILING_S})"
            )
        self.protected.discard(rp.index)
        self.respawn(rp.index)

    async def drain_until_a_handoff(self, tries: int = 3) -> None:
        """A drain whose held runs all finished `work` between the soak's read and the SIGTERM
        hands nothing off and proves nothing (`judge_drains` accepts it): drain another busy
        runner, up to `tries` times, until one run is handed off."""
        for _ in range(tries):
            await self.drain(outage=False)
            if await self.handed_off(self.drain_log[-1]):
                return
            self.say("the drain caught no run mid-node (they finished first); draining again")

    async def handed_off(self, drain: Drain) -> bool:
        assert self.store is not None
        for run_id, attempt in drain.held.items():
            with contextlib.suppress(StoreError):
                for e in await _events(self.store, run_id):
                    kind, moved = e.data.get("kind"), e.data.get("attempt") == attempt + 1
                    if e.type == "run_queued" and kind == "handoff" and moved:
                        return True
        return False

    async def nats_outage(self) -> None:
        # The runner to drain is chosen first (it holds runs mid-`work`), so the runs are
        # still held when it gets SIGTERM an instant after the server is gone.
        target = await self.busiest(within=30)
        if target[0] is not None:
            self.protected.add(target[0].index)
        window = Window("nats", time.monotonic())
        self.windows.append(window)
        self.nats_down = True
        try:
            await asyncio.to_thread(self.server.stop)
            stopped = time.monotonic()
            self.say("nats-server stopped")
            # A runner drained now cannot publish its handoffs: the sweeper must.
            await self.drain(outage=True, target=target)
            await asyncio.sleep(max(0.0, self.cfg.nats_outage_s - (time.monotonic() - stopped)))
        finally:
            await asyncio.to_thread(self.server.start)
            self.nats_down = False
            window.end = time.monotonic()
            self.report.nats_restarts += 1
            self.say(f"nats-server started again at {self.server.url}")

    def cluster_faults(self) -> ClusterFaults:
        """The cluster's fault maker (`tests/soak_cluster.py`), made once."""
        if self.faults is None:
            assert isinstance(self.server, Cluster)
            self.faults = ClusterFaults(
                self.server,
                stream=self.names.runs_stream,
                consumer=self.names.consumer,
                backstop=(self.names.advisory_stream, self.names.backstop_consumer),
                outage_s=self.cfg.leader_outage_s,
                pause_s=self.cfg.pause_s,
                rng=random.Random(self.cfg.seed + 1),
                say=self.say,
            )
        return self.faults

    async def server_fault(self, kind: str) -> None:
        """One fault of one cluster node, over once the cluster is whole again (restarted,
        resumed, current, every leader elected)."""
        window = Window("cluster", time.monotonic())
        self.windows.append(window)
        try:
            fault = await self.cluster_faults().run(kind)
        finally:
            window.end = time.monotonic()
        self.report.server_faults[kind] += 1
        self.report.leader_kills += kind == "kill_stream_leader"
        self.report.max_leaderless_s = max(self.report.max_leaderless_s, fault.broker_wait_s)

    async def store_fault(self) -> None:
        """Hold SQLite's write lock longer than the busy timeout: every writer of every process
        waits, then gets SQLITE_BUSY (`StoreUnavailable`); readers go on (WAL)."""
        window = Window("store", time.monotonic())
        self.windows.append(window)
        seconds = self.cfg.store_fault_s
        self.say(f"store fault: holding the SQLite write lock for {seconds:.0f}s")
        try:
            await asyncio.to_thread(self.hold_write_lock, seconds)
        finally:
            window.end = time.monotonic()
            self.report.store_fault_windows += 1
            self.say("store fault over")

    def hold_write_lock(self, seconds: float, on_locked: Callable[[], None] | None = None) -> None:
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        try:
            conn.execute("BEGIN EXCLUSIVE")
            if on_locked is not None:
                on_locked()
            time.sleep(seconds)
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    async def post_engine_store_fault(self) -> None:
        """A store outage opened at the instant a run's last node is done and its `finished`
        status write goes (the seam, `tests/soak_seam.py`), held past two busy timeouts: the
        store refuses that write (`StoreUnavailable`), which must end as a nak with the transient
        delay and no DLQ record, with teardown and release still attempted (SPEC v2.2 §5.1,
        §5.6; ADR-0010); the run stays `running` until its lease lapses, then the redelivery's
        adoption finds the last checkpoint written and finishes it. Every other writer of the
        fleet meets the outage too (lease refreshes, checkpoints, claims)."""
        self.seam.arm()
        caught = await self.seam.caught(POST_ENGINE_CATCH_S, self.stop)
        if caught is None and not self.seam.disarm():
            caught = await self.seam.caught(1.0, self.stop)  # caught as we gave up
        if caught is None:
            self.say("post-engine store fault: no `finished` status write to catch; skipped")
            return
        holder = next((rp for rp in self.runners if rp.proc.pid == caught.pid), None)
        if holder is not None:
            self.protected.add(holder.index)  # neither killed nor drained while it is caught
        window = Window("post_engine", time.monotonic())
        self.windows.append(window)
        self.caught.append(caught.run_id)
        seconds = self.cfg.post_engine_store_fault_s
        self.say(
            f"post-engine store fault: run {caught.run_id} is at its status write; holding the"
            f" SQLite write lock for {seconds:.0f}s"
        )
        try:
            await asyncio.to_thread(
                self.hold_write_lock, seconds, functools.partial(self.seam.locked, caught.run_id)
            )
        finally:
            window.end = time.monotonic()
            self.report.post_engine_windows += 1
            if holder is not None:
                self.protected.discard(holder.index)
            self.say("post-engine store fault over")

    async def send_poison(self) -> None:
        """A few deliberately bad messages; each must end in the DLQ with its reason."""
        assert self.js is not None
        await self.until(lambda: bool(self.launched))  # the intruder knocks at a real run
        victim = self.launched[-1]
        old = utcnow() - timedelta(minutes=5)
        for i in range(self.cfg.poison_per_batch):
            kind = i % 4
            headers: dict[str, str] | None = None
            if kind == 0:
                reason, body = "malformed", b"\xff" + self.rng.randbytes(self.rng.randrange(64))
            elif kind == 1:
                reason, body = "malformed", json.dumps({"v": 1, "run_id": i}).encode()
            elif kind == 2:
                lost = RunMessage(
                    run_id=new_run_id(), tenant=TENANT, attempt=1, kind="launch", published_at=old
                )
                reason, (body, headers) = "run_not_found", encode(lost)
            else:
                intruder = RunMessage(
                    run_id=victim,
                    tenant="intruder",
                    attempt=1,
                    kind="launch",
                    published_at=utcnow(),
                )
                reason, body = "tenant_mismatch", intruder.model_dump_json().encode()
            ack = await self.js.publish(
                self.names.runs_subject, body, stream=self.names.runs_stream, headers=headers
            )
            self.poison[ack.seq] = reason
        if not self.cfg.hostile_poison:
            return
        for hostile in hostile_bodies(victim, old):
            ack = await self.js.publish(
                self.names.runs_subject,
                hostile.body,
                stream=self.names.runs_stream,
                headers=hostile.headers,
            )
            self.poison[ack.seq] = "malformed"
            self.report.hostile += 1
