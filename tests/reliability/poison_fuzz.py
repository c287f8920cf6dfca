"""The poison fuzz, long mode: the CI fuzz's mix (`poison.py`) at volume, at several runners.

    python -m tests.reliability.poison_fuzz --messages 100000 --runners 3 [--seed N]
        [--slots 16] [--good-every 250] [--large 100] [--deadline S] [--data DIR] [--keep]

It starts its own `nats-server` in a temporary directory, the streams, a SQLite store and
filesystem blobs with the runner tests' short timings (`tests/runner/callables.open_fleet`),
then `--runners` real `runfleet runner` processes (`tests/runner/procs.py`). Two victim runs are
made first (one finished at attempt 1, one resumed and finished at attempt 2); then it publishes
`--messages` messages: garbage bytes, not-JSON, truncated and wrongly typed JSON, hostile bodies
(`hostile.py`: integers past the 4 300-digit limit, deep nesting, huge strings, bad UTF-8,
lone surrogates, NaN, duplicate keys, the 5 000-digit and 200 000-deep extremes; at most
`--large` of them over 256 KiB), valid messages for unknown runs, other tenants, attempts ahead
and behind, newer schemas, copies of settled runs — and launches a good run every
`--good-every` messages.

At the end it prints where every message ended, by expected fate and by kind, and the runners'
own counts, and exits 1 on any violation: a runner that exited (or whose loop failed, or whose
`/healthz` is not 200); a message whose end is not the one its label allows (its DLQ reason,
acked — and then counted under that reason by the runners' metrics — or still in the stream);
a DLQ body that changed, or a record nobody sent; a good run not finished exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from runner.localnats import NatsServer
from tests.reliability.accounting import Account, Label, account, label, pivot
from tests.reliability.poison import make_victims, metric_counts, stream
from tests.runner.callables import open_fleet
from tests.runner.conftest import Fleet
from tests.runner.procs import RunnerProcess, ledger, spawn_runner, wait_ready, workflow

RUNNER_ENV = {"RUNFLEET_LAGGING_DELAY": "0.3s"}
"""Lost runs and attempts ahead reach their last delivery in ~3 s, as in the CI fuzz."""


@dataclass(frozen=True)
class FuzzConfig:
    messages: int = 100_000
    runners: int = 3
    slots: int = 16
    seed: int = 0
    good_every: int = 250
    large: int = 100
    concurrency: int = 64
    deadline_s: float = 3600.0
    data: Path | None = None
    keep: bool = False


@dataclass
class Report:
    cfg: FuzzConfig
    acc: Account
    deliveries: Counter[tuple[str, ...]]
    dlq_metric: Counter[tuple[str, ...]]
    exits: dict[str, int | None]
    good: int
    violations: list[str]
    elapsed_s: float
    data_dir: Path

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self) -> str:
        runners = ", ".join(
            f"{k} {'alive' if v is None else f'exit {v}'}" for k, v in self.exits.items()
        )
        metrics = Counter({(k[1], k[0]): v for k, v in self.deliveries.items()})
        return "\n\n".join(
            [
                pivot(self.acc.by_expected, "expected fate"),
                pivot(self.acc.by_kind, "kind"),
                "the runners' runfleet_deliveries_total over the fuzz (summed):\n"
                + pivot(metrics, "reason", total="all"),
                "runfleet_dlq_records_total (summed): "
                + ", ".join(f"{k[0]} {v}" for k, v in sorted(self.dlq_metric.items())),
                f"{len(self.acc.observed)} messages sent, {len(self.acc.observed)} accounted for "
                f"({len(self.acc.records)} DLQ records, {self.acc.count('acked')} acked, "
                f"{self.acc.count('in_stream')} still in the stream); {self.good} good runs "
                f"finished once each; runners: {runners} (0 exits during the fuzz: "
                f"{sum(v is not None for v in self.exits.values()) == 0}); "
                f"{len(self.violations)} violations; {self.elapsed_s:.0f} s",
            ]
        )


async def _metrics(runners: list[RunnerProcess]) -> list[str]:
    return [(await r.get("/metrics"))[1] for r in runners]


def _summed(pages: list[str], family: str, *labels: str) -> Counter[tuple[str, ...]]:
    total: Counter[tuple[str, ...]] = Counter()
    for page in pages:
        total.update(metric_counts(page, family, *labels))
    return total


def _progress(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {text}", file=sys.stderr, flush=True)


async def _publish(
    fleet: Fleet, cfg: FuzzConfig, rng: random.Random, book: Path, t0: float
) -> tuple[dict[int, Label], list[str]]:
    victims = await make_victims(fleet, book)
    sent: dict[int, Label] = {}
    good: list[str] = []
    batch: list[tuple[Label, asyncio.Future[int]]] = []

    async def flush() -> None:
        for lab, fut in batch:
            sent[await fut] = lab
        batch.clear()

    async def one(body: bytes, headers: dict[str, str] | None) -> int:
        ack = await fleet.js.publish(
            fleet.names.runs_subject, body, stream=fleet.names.runs_stream, headers=headers
        )
        assert not ack.duplicate, "a fuzzed message was deduplicated away"
        return int(ack.seq)

    for i, p in enumerate(stream(victims, rng, cfg.messages, large=cfg.large)):
        batch.append((label(p), asyncio.ensure_future(one(p.body, p.headers))))
        if len(batch) >= cfg.concurrency:
            await flush()
        if i % cfg.good_every == 0:
            run = await fleet.launch(
                workflow("one_step"), {"ledger": str(book), "tag": f"good{len(good)}"}
            )
            good.append(run.run_id)
        if (i + 1) % 10_000 == 0:
            _progress(t0, f"published {i + 1}, {await fleet.stream_messages()} in the work stream")
    await flush()
    return sent, good


async def _settle(
    fleet: Fleet, sent: dict[int, Label], runners: list[RunnerProcess], cfg: FuzzConfig, t0: float
) -> None:
    """Wait until the DLQ holds what it must and only the nak'd messages remain (or the
    deadline, or a runner exit: the accounting then says what is missing)."""
    want_dlq = sum(lab.fate == "dlq" for lab in sent.values())
    want_waiting = sum(lab.fate == "nak" for lab in sent.values())
    deadline = time.monotonic() + cfg.deadline_s
    last = 0.0
    while time.monotonic() < deadline:
        dlq = int((await fleet.js.stream_info(fleet.names.dlq_stream)).state.messages)
        waiting = await fleet.stream_messages()
        if dlq >= want_dlq and waiting <= want_waiting:
            return
        if any(r.returncode is not None for r in runners):
            _progress(t0, "a runner exited; accounting now")
            return
        if time.monotonic() - last > 15:
            _progress(t0, f"DLQ {dlq}/{want_dlq}, work stream {waiting} (≥ {want_waiting} waiting)")
            last = time.monotonic()
        await asyncio.sleep(1.0)
    _progress(t0, "deadline reached; accounting now")


async def _check_runners(runners: list[RunnerProcess], violations: list[str]) -> list[str]:
    """0 exits, every loop alive, `/healthz` 200; returns the live runners' `/metrics`."""
    for r in runners:
        if r.returncode is not None:
            violations.append(f"runner {r.owner} exited {r.returncode} during the fuzz")
        if "task loop:" in r.log():
            violations.append(f"runner {r.owner}: a loop failed (see {r.log_path})")
    alive = [r for r in runners if r.returncode is None]
    for r in alive:
        status, health = await r.get("/healthz")
        if status != 200 or not json.loads(health).get("ok"):
            violations.append(f"runner {r.owner}: /healthz {status} {health}")
    return await _metrics(alive)


async def _check_good_runs(
    fleet: Fleet, good: list[str], book: Path, violations: list[str]
) -> None:
    """Every good run launched during the fuzz finished, and ran its node exactly once."""
    for run_id in good:
        try:
            await fleet.wait_status(run_id, "finished", within=60)
        except AssertionError:
            doc = await fleet.store.get_run(run_id)
            violations.append(f"good run {run_id}: {doc.status} {doc.failure_code or ''}")
    ran = ledger(book)
    for i, run_id in enumerate(good):
        if ran[f"good{i}"] != 1:
            violations.append(f"good run {run_id} ran {ran[f'good{i}']} times")


async def run_fuzz(cfg: FuzzConfig) -> Report:
    t0 = time.monotonic()
    root = cfg.data or Path(tempfile.mkdtemp(prefix="runfleet-fuzz-"))
    root.mkdir(parents=True, exist_ok=True)
    server = NatsServer(root / "nats")
    server.start()
    rng = random.Random(cfg.seed)
    book = root / "ledger"
    violations: list[str] = []
    before: list[str] = []
    after: list[str] = []
    exits: dict[str, int | None] = {}
    try:
        async with open_fleet(root, server) as fleet:
            runners = [
                spawn_runner(
                    fleet, root / f"fuzz{i}.log", args=("--slots", str(cfg.slots)), env=RUNNER_ENV
                )
                for i in range(cfg.runners)
            ]
            try:
                for r in runners:
                    await wait_ready(r)
                before = await _metrics(runners)
                sent, good = await _publish(fleet, cfg, rng, book, t0)
                _progress(t0, f"published {len(sent)} messages and {len(good)} good runs")
                await _settle(fleet, sent, runners, cfg, t0)
                exits = {r.owner: r.returncode for r in runners}
                after = await _check_runners(runners, violations)
                await _check_good_runs(fleet, good, book, violations)
            finally:
                for r in runners:
                    if r.returncode is None:
                        code = await r.stop(within=60)
                        if code != 0:
                            violations.append(f"runner {r.owner or r.pid}: drain exit {code}")
            acc = await account(fleet, sent)
    finally:
        server.stop()
    by = ("disposition", "reason")
    deliveries = _summed(after, "runfleet_deliveries", *by) - _summed(
        before, "runfleet_deliveries", *by
    )
    dlq_metric = _summed(after, "runfleet_dlq_records", "reason") - _summed(
        before, "runfleet_dlq_records", "reason"
    )
    # The runners' own account agrees: each acked message counted under its reason, each
    # record under its reason (at least once: a redelivery after `ack_wait` counts again).
    for reason in sorted({lab.reason for lab in sent.values() if lab.fate == "ack"}):
        acked = sum(
            1 for s, lab in sent.items() if lab.reason == reason and acc.observed[s] == "acked"
        )
        if deliveries["ack", reason] < acked:
            violations.append(
                f"ack {reason}: {acked} acked, the runners counted {deliveries['ack', reason]}"
            )
    for reason, n in Counter(r.reason for r in acc.records.values()).items():
        if dlq_metric[(reason,)] < n:
            violations.append(
                f"{n} DLQ records {reason}, the runners counted {dlq_metric[(reason,)]}"
            )
    report = Report(
        cfg,
        acc,
        deliveries,
        dlq_metric,
        exits,
        len(good),
        violations + acc.violations,
        time.monotonic() - t0,
        root,
    )
    if cfg.data is None and not cfg.keep and report.ok:
        shutil.rmtree(root, ignore_errors=True)
    return report


def parse_args(argv: list[str] | None = None) -> FuzzConfig:
    p = argparse.ArgumentParser(
        prog="python -m tests.reliability.poison_fuzz", description=__doc__.split("\n")[0]
    )
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--runners", type=int, default=3)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument(
        "--good-every", type=int, default=250, metavar="N", help="a good run every N messages"
    )
    p.add_argument("--large", type=int, default=100, help="at most this many bodies over 256 KiB")
    p.add_argument("--concurrency", type=int, default=64, help="publishes in flight")
    p.add_argument("--deadline", type=float, default=3600.0, metavar="S", help="for the settling")
    p.add_argument("--data", type=Path, default=None, help="keep everything here")
    p.add_argument("--keep", action="store_true", help="keep the temp dir even on success")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 10**6)
    return FuzzConfig(
        messages=a.messages,
        runners=a.runners,
        slots=a.slots,
        seed=seed,
        good_every=a.good_every,
        large=a.large,
        concurrency=a.concurrency,
        deadline_s=a.deadline,
        data=a.data,
        keep=a.keep,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"poison fuzz: seed {cfg.seed}, {cfg.messages} messages, {cfg.runners} runners, {started}",
        file=sys.stderr,
    )
    report = asyncio.run(run_fuzz(cfg))
    print(report.text())
    kept = not report.ok or cfg.data is not None or cfg.keep
    print(f"\nseed {cfg.seed}; data {report.data_dir}" + (" (kept)" if kept else " (removed)"))
    for v in report.violations[:50]:
        print(f"VIOLATION: {v}")
    if len(report.violations) > 50:
        print(f"... and {len(report.violations) - 50} more")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
