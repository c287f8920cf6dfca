"""Real `runfleet` processes for the runner tests: a `runfleet runner` started on the fleet's
namespace and store (`fleet.env()` plus extra variables), one-shot CLI commands, ledgers.

A runner process is ready when its log says `runner <owner>: N slots, http :PORT` (the CLI prints
it after `Runner.start()` returned, so the consumer is bound and the endpoints serve); its stdout
and stderr go to one log file that tests read. Waits poll with a deadline, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from runner.runner import Runner
from store import RunDocument
from tests.runner.conftest import Fleet, eventually

RUNFLEET = Path(sys.executable).parent / "runfleet"
WORKFLOWS = Path(__file__).parent / "ledger_workflows"
READY = re.compile(r"runner (?P<owner>\S+): (?P<slots>\d+) slots, http :(?P<port>\d+)")


def workflow(name: str) -> str:
    """The source text of `ledger_workflows/<name>.yaml`."""
    return (WORKFLOWS / f"{name}.yaml").read_text()


def ledger(path: Path) -> Counter[str]:
    """How many times each node appended its line to the ledger file."""
    if not path.exists():
        return Counter()
    return Counter(line.strip() for line in path.read_text().splitlines() if line.strip())


def process_env(fleet: Fleet, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        **os.environ,
        **fleet.env(),
        "RUNFLEET_HTTP_HOST": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


@dataclass
class RunnerProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    owner: str = ""
    port: int = 0
    slots: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def wait_exit(self, within: float) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        try:
            await eventually(exited, within=within)
        except AssertionError:
            raise AssertionError(
                f"runner {self.owner or self.pid} still alive after {within}s; log:\n{self.log()}"
            ) from None
        return self.proc.wait()

    async def stop(self, within: float = 30.0) -> int:
        """SIGTERM (a drain) and wait for the exit code."""
        self.signal(signal.SIGTERM)
        return await self.wait_exit(within)

    def kill(self) -> None:
        """SIGKILL and reap, so no zombie or ResourceWarning outlives a test."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    async def get(self, path: str) -> tuple[int, str]:
        """GET `path` on the runner's health/metrics port: (status, body)."""
        url = f"http://127.0.0.1:{self.port}{path}"

        def fetch() -> tuple[int, str]:
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    return int(resp.status), resp.read().decode()
            except urllib.error.HTTPError as exc:
                with exc:
                    return int(exc.code), exc.read().decode()

        return await asyncio.to_thread(fetch)


def spawn_runner(
    fleet: Fleet,
    log_path: Path,
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> RunnerProcess:
    """Start `runfleet runner ARGS` without waiting for it (see `wait_ready`)."""
    log_file = log_path.open("wb")
    try:
        proc = subprocess.Popen(
            [str(RUNFLEET), "runner", *args],
            env=process_env(fleet, env),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    finally:
        log_file.close()
    return RunnerProcess(proc, log_path)


async def wait_ready(runner: RunnerProcess, within: float = 30.0) -> RunnerProcess:
    """Wait for the start line; fail early (with the log) if the process exits instead."""

    async def ready() -> bool:
        if READY.search(runner.log()):
            return True
        if runner.returncode is not None:
            raise AssertionError(
                f"runner exited {runner.returncode} before it started; log:\n{runner.log()}"
            )
        return False

    await eventually(ready, within=within)
    found = READY.search(runner.log())
    assert found is not None
    runner.owner = found["owner"]
    runner.slots = int(found["slots"])
    runner.port = int(found["port"])
    return runner


@asynccontextmanager
async def runner_process(
    fleet: Fleet,
    name: str,
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> AsyncIterator[RunnerProcess]:
    """A started `runfleet runner`; killed and reaped at exit if the test left it running."""
    runner = spawn_runner(fleet, fleet.tmp / f"{name}.log", args=args, env=env)
    try:
        await wait_ready(runner)
        yield runner
    finally:
        runner.kill()


async def run_cli(
    fleet: Fleet, *args: str, env: dict[str, str] | None = None, within: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """One `runfleet ARGS` command on the fleet, run to completion."""
    return await asyncio.to_thread(
        subprocess.run,
        [str(RUNFLEET), *args],
        env=process_env(fleet, env),
        capture_output=True,
        text=True,
        timeout=within,
        check=False,
    )


async def wait_for_ledger(path: Path, node: str, times: int = 1, within: float = 30.0) -> None:
    """Wait until `node` has appended at least `times` lines to the ledger."""

    async def seen() -> bool:
        return ledger(path)[node] >= times

    await eventually(seen, within=within)


def released(fleet: Fleet, run_id: str) -> Callable[[], Awaitable[RunDocument | None]]:
    """A probe: the run once no execution holds its lease (the release follows the status
    write, SPEC §5.4 order)."""

    async def probe() -> RunDocument | None:
        doc = await fleet.store.get_run(run_id)
        return doc if doc.lease is None else None

    return probe


def sample(runner: Runner, name: str, **labels: str) -> float:
    """One sample of an in-process runner's metrics (0 when never counted)."""
    return runner.metrics.registry.get_sample_value(name, labels) or 0.0
