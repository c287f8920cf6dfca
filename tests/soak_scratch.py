"""The scratch soak: runs whose scratch must follow them across runner processes on different
"hosts", while the runners are killed on purpose in the bank and in the restore (SPEC v2.2
§7.2b-§7.5, §13.10; issue 14; adr/0011 and its amendment).

    python -m tests.soak_scratch --runs 12 --runners 2 --seed 3 [--mib 4] [--keep]

It starts `nats-server`, moto's S3 server (in this process), a SQLite store and N `runfleet
runner` processes, each on its own `RUNFLEET_DATA` (a new one at every restart: another host),
all on the same store and bucket — a deployment that banks (not host-backed, §7.2b). Each run:

    write (tool: `--mib` MiB of random bytes and their sha256 into the scratch) -> ask (human)
        -> check1 (tool: the scratch against its sha256) -> ask2 (human) -> check2 (tool)

A check that does not find its scratch byte for byte appends the run to the `lost` ledger and
goes on (so a silent loss is counted, never hidden by a failure). While the runs flow the soak
answers the human pauses through the publisher and breaks things:

- kill during bank: a run whose park was written while its lease is still held is in its
  teardown's bank; its runner is SIGKILLed then (and restarted).
- kill during restore: a resumed run claimed and not yet `sandbox_scratch_restored`; its runner
  is SIGKILLed then.
- SIGKILL mid-node: a random runner every `--kill-every` s.

A run either finishes with both checks `ok`, or is refused `SCRATCH_NOT_PORTABLE` (at the
surface, or parked so by admission) and left parked for an operator. The verdict (exit 1 on a
violation): 0 lost scratches (no `lost` line, no check output other than `ok`); every run
finished or parked `SCRATCH_NOT_PORTABLE`; no run left with a live lease at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats

from engine.failures import FailureCode
from engine.loader import load_workflow
from engine.refusals import ScratchNotPortable
from engine.resume import ResumeRequest
from publisher import DlqStore, Publisher, WireNames, WireSettings, ensure_streams
from runner.localnats import NatsServer
from store import RunDocument, RunfleetError, RunStatus, lease_is_free, utcnow
from store.blobs_fs import FilesystemBlobStore
from store.sqlite import SqliteRunStore
from tests.soak import READY, REPO, TIMING, RunnerProc
from tests.soak_scratch_plan import WORKFLOW, ScratchReport, ScratchSoakConfig
from tests.support.s3server import S3Server, running_s3_server

TENANT = "default"
SKEW = timedelta(seconds=0.5)  # TIMING's LEASE_SKEW
WIRE_TIMING = {
    "lease_ttl", "lease_skew", "max_deliver", "duplicate_window", "sweeper_interval",
    "sweeper_grace", "publish_attempts", "publish_retry_budget", "publish_timeout",
}  # fmt: skip


class ScratchSoak:
    def __init__(self, cfg: ScratchSoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.seen_a_bank = False
        self.root = Path(cfg.data or tempfile.mkdtemp(prefix="runfleet-soak-scratch-")).resolve()
        self.db = self.root / "runs.db"
        self.lost = self.root / "lost"
        self.names = WireNames(f"soaksc{uuid.uuid4().hex[:8]}")
        self.nats = NatsServer(self.root / "nats")
        self.exits = contextlib.ExitStack()
        self.s3: S3Server | None = None
        self.bucket = ""
        self.report = ScratchReport(config=dataclasses.asdict(cfg) | {"data": str(cfg.data)})
        self.runners: list[RunnerProc] = []
        self.history: list[RunnerProc] = []
        self.run_ids: list[str] = []
        self.targeted: set[tuple[str, int, str]] = set()
        """(run id, attempt, bank or restore) already drawn for a kill."""
        self.answered: dict[str, str] = {}
        """run id -> the pending node last answered (a resume is sent once per pause)."""
        self.parked: set[str] = set()
        self.started = time.monotonic()
        self.store: SqliteRunStore | None = None
        self.publisher: Publisher | None = None
        self.blobs: FilesystemBlobStore | None = None
        self.nc: Any = None

    def say(self, text: str) -> None:
        if not self.cfg.quiet:
            print(f"[scratch soak {time.monotonic() - self.started:6.1f}s] {text}", file=sys.stderr)

    def env(self, host: Path) -> dict[str, str]:
        assert self.s3 is not None
        endpoint = self.s3.endpoint_url
        return {
            **os.environ,
            "RUNFLEET_DATA": str(host),
            "RUNFLEET_NATS_URL": self.nats.url,
            "RUNFLEET_NAMESPACE": self.names.namespace,
            "RUNFLEET_STORE_URL": f"sqlite:///{self.db}",
            "RUNFLEET_BLOB_URL": f"s3://{self.bucket}/soak?endpoint={endpoint}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "RUNFLEET_TENANT": TENANT,
            "RUNFLEET_HTTP_HOST": "127.0.0.1",
            "RUNFLEET_HTTP_PORT": "0",
            "PYTHONUNBUFFERED": "1",
            **{f"RUNFLEET_{k}": v for k, v in TIMING.items()},
            # a bank of a few MiB on two loaded cores: room within the budget (§7.3)
            "RUNFLEET_SCRATCH_BANK_BUDGET": "20s",
            "RUNFLEET_TEARDOWN_BUDGET": "30s",
        }

    def spawn(self, index: int) -> RunnerProc:
        host = self.root / f"host-{index}-{len(self.history)}"  # a new host at every start
        log_path = self.root / f"runner-{index}-{len(self.history)}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "runfleet"),
                    "runner",
                    "--slots",
                    str(self.cfg.slots),
                ],
                env=self.env(host),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        rp = RunnerProc(index, proc, log_path, time.monotonic())
        self.history.append(rp)
        return rp

    async def wait_ready(self, rp: RunnerProc, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while not rp.ready:
            found = READY.search(rp.log())
            if found:
                rp.owner, rp.port, rp.ready = found["owner"], int(found["port"]), True
            elif rp.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"runner not ready:\n{rp.tail()}")
            else:
                await asyncio.sleep(0.1)

    async def kill(self, rp: RunnerProc, why: str) -> None:
        """SIGKILL and restart at once, on a new host."""
        rp.expected_exit = "killed"
        rp.proc.kill()
        await asyncio.to_thread(rp.proc.wait)
        self.say(f"SIGKILL {rp.owner} ({why})")
        self.runners[rp.index] = self.spawn(rp.index)

    def owner_of(self, doc: RunDocument) -> RunnerProc | None:
        if doc.lease is None:
            return None
        return next((rp for rp in self.runners if rp.ready and rp.owner == doc.lease.owner), None)

    # -- the run ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.s3 = self.exits.enter_context(running_s3_server())
        self.bucket = await self.s3.new_bucket()
        await asyncio.to_thread(self.nats.start)
        timing: dict[str, Any] = {k.lower(): v for k, v in TIMING.items()}
        wire = WireSettings(
            **{k: v for k, v in timing.items() if k in WIRE_TIMING},
            namespace=self.names.namespace,
            data=self.root / "data",
            nats_url=self.nats.url,
        )
        self.nc = await nats.connect(self.nats.url)
        js = self.nc.jetstream()
        await ensure_streams(js, self.names, wire)
        self.store = await SqliteRunStore.open(self.db)
        self.blobs = FilesystemBlobStore(self.root / "dlq-blobs")
        dlq = DlqStore(js, self.names, self.blobs)
        self.publisher = Publisher(
            store=self.store, nc=self.nc, js=js, settings=wire, names=self.names, dlq=dlq
        )
        self.runners = [self.spawn(i) for i in range(self.cfg.runners)]
        for rp in self.runners:
            await self.wait_ready(rp)

    async def close(self) -> None:
        for rp in self.history:
            if rp.proc.poll() is None:
                rp.proc.kill()
            rp.proc.wait()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.store is not None:
            await self.store.close()
        if self.blobs is not None:
            await self.blobs.close()
        await asyncio.to_thread(self.nats.stop)
        self.exits.close()
        if not self.cfg.keep and self.cfg.data is None:
            shutil.rmtree(self.root, ignore_errors=True)

    async def launch(self) -> None:
        assert self.publisher is not None
        loaded = load_workflow(WORKFLOW, "soak_scratch.yaml")
        for _ in range(self.cfg.runs):
            doc = await self.publisher.launch(
                loaded, {"mib": self.cfg.mib, "lost": str(self.lost)}, tenant=TENANT
            )
            self.run_ids.append(doc.run_id)
        self.report.runs = len(self.run_ids)

    async def step(self, doc: RunDocument) -> bool:
        """One look at one run: a fault to inject or a pause to answer. True when settled."""
        assert self.publisher is not None and self.store is not None
        if doc.status is RunStatus.FINISHED:
            return lease_is_free(doc, utcnow(), SKEW)
        if doc.failure_code == FailureCode.SCRATCH_NOT_PORTABLE:
            if doc.run_id not in self.parked:
                self.parked.add(doc.run_id)
                self.report.refused_admission += 1
                self.say(f"{doc.run_id[-8:]} parked SCRATCH_NOT_PORTABLE: {doc.error}")
            return lease_is_free(doc, utcnow(), SKEW)
        if doc.scratch is not None and doc.scratch.state == "banked":
            self.seen_a_bank = True
        rp = self.owner_of(doc)  # a live runner holds the lease
        banking = rp is not None and doc.status is RunStatus.PAUSED_WAITING_HUMAN
        restoring = rp is not None and doc.status is RunStatus.RUNNING
        if banking and self.target((doc.run_id, doc.attempt, "bank"), self.cfg.bank_kill_p):
            assert rp is not None
            self.report.kills_bank += 1
            await self.kill(rp, f"during the bank of {doc.run_id[-8:]}")
        elif restoring and await self.unrestored(doc):
            assert rp is not None
            if self.target((doc.run_id, doc.attempt, "restore"), self.cfg.restore_kill_p):
                self.report.kills_restore += 1
                await self.kill(rp, f"during the restore of {doc.run_id[-8:]}")
        free = lease_is_free(doc, utcnow(), SKEW)
        if doc.status is RunStatus.PAUSED_WAITING_HUMAN and free:
            pending = (doc.checkpoint.pending_interaction or {}) if doc.checkpoint else {}
            node = str(pending.get("node", ""))
            if node and self.answered.get(doc.run_id) != f"{doc.attempt}:{node}":
                try:
                    await self.publisher.resume(
                        doc.run_id, ResumeRequest(answers={"go": True}), tenant=TENANT
                    )
                    self.answered[doc.run_id] = f"{doc.attempt + 1}:{node}"
                except ScratchNotPortable as exc:
                    self.parked.add(doc.run_id)
                    self.report.refused_surface += 1
                    self.say(f"{doc.run_id[-8:]} refused at the surface: {exc}")
                    return True
                except RunfleetError as exc:
                    self.say(f"{doc.run_id[-8:]} resume not taken yet: {exc}")
        return doc.run_id in self.parked and free

    def target(self, key: tuple[str, int, str], p: float) -> bool:
        """Each bank and each restore of an attempt is drawn for a kill once.

        No bank is killed until one bank has been seen to land: with few runs a fair draw (and
        one SIGKILL takes every bank its runner holds) kills every bank now and then, and a soak
        whose banks all died proves refusals but never a bank followed to its restore."""
        if key in self.targeted or (key[2] == "bank" and not self.seen_a_bank):
            return False
        self.targeted.add(key)
        return self.rng.random() < p

    async def unrestored(self, doc: RunDocument) -> bool:
        """A resumed run claimed on a bank and not yet past its restore."""
        assert self.store is not None
        if doc.scratch is None or doc.scratch.state != "banked":
            return False
        events = await self.store.read_events(doc.run_id, 0, 10_000)
        claims = [i for i, e in enumerate(events) if e.type == "run_claimed"]
        if not claims or events[claims[-1]].attempt != doc.attempt:
            return False
        after = [e.type for e in events[claims[-1] :]]
        return "sandbox_scratch_restored" not in after and "node_started" not in after

    async def drive(self) -> None:
        assert self.store is not None
        deadline = self.started + self.cfg.deadline_s
        next_kill = time.monotonic() + self.cfg.kill_every
        settled: set[str] = set()
        while len(settled) < len(self.run_ids) and time.monotonic() < deadline:
            for run_id in self.run_ids:
                if run_id not in settled and await self.step(await self.store.get_run(run_id)):
                    settled.add(run_id)
            for rp in self.runners:
                if not rp.ready:
                    await self.wait_ready(rp)
            if time.monotonic() >= next_kill and len(settled) < len(self.run_ids):
                next_kill = time.monotonic() + self.cfg.kill_every * self.rng.uniform(0.5, 1.5)
                self.report.kills_random += 1
                await self.kill(self.rng.choice(self.runners), "at random")
            await asyncio.sleep(0.05)
        if len(settled) < len(self.run_ids):
            self.report.violations.append(
                f"deadline: {len(self.run_ids) - len(settled)} runs neither finished nor parked"
            )

    async def verdict(self) -> None:
        assert self.store is not None
        lines = self.lost.read_text().splitlines() if self.lost.exists() else []
        self.report.lost_scratches = len(lines)
        for line in lines:
            self.report.violations.append(f"lost scratch: {line}")
        for run_id in self.run_ids:
            doc = await self.store.get_run(run_id)
            outputs = doc.checkpoint.outputs if doc.checkpoint else {}
            if doc.status is RunStatus.FINISHED:
                self.report.finished += 1
                if (outputs.get("check1"), outputs.get("check2")) != ("ok", "ok"):
                    self.report.violations.append(f"{run_id}: checks {outputs}")
            elif run_id not in self.parked:
                self.report.violations.append(f"{run_id}: ended {doc.status} {doc.failure_code}")
            if doc.lease is not None and doc.lease.expires_at > utcnow():
                self.report.violations.append(f"{run_id}: a live lease at the end")
            for ev in await self.store.read_events(run_id, 0, 10_000):
                if ev.type == "sandbox_scratch_banked" and ev.data.get("banked"):
                    self.report.banked += 1
                if ev.type == "sandbox_scratch_restored" and ev.data.get("restored"):
                    self.report.restored += 1


async def run_scratch_soak(cfg: ScratchSoakConfig) -> ScratchReport:
    soak = ScratchSoak(cfg)
    try:
        await soak.start()
        await soak.launch()
        await soak.drive()
        await soak.verdict()
    finally:
        soak.report.wall_s = time.monotonic() - soak.started
        soak.report.data_dir = str(soak.root)
        await soak.close()
    return soak.report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = ScratchSoakConfig()
    for name in ("runs", "runners", "slots", "mib", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    for name in ("kill_every", "bank_kill_p", "restore_kill_p", "deadline_s"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name)
        )
    parser.add_argument("--data", type=Path)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    cfg = ScratchSoakConfig(**vars(parser.parse_args(argv)))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    report = asyncio.run(run_scratch_soak(cfg))
    print(f"seed {cfg.seed}\n{report.table()}")
    for violation in report.violations:
        print(f"VIOLATION {violation}")
    return 0 if not report.violations else 1


if __name__ == "__main__":
    raise SystemExit(main())
