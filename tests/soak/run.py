"""The soak put together: `Soak` joins the fleet, the workload, the faults, the watchers and
the verdict, and `drive` runs their loops until every run is finished (or the deadline, or
SIGINT/SIGTERM); `run_soak` is the main flow (start, drive, analyse, close), shared by the
command line and the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from tests.soak.config import SoakConfig
from tests.soak.faults import Faults
from tests.soak.report import Report
from tests.soak.verdict import Verdict
from tests.soak.watch import Watch
from tests.soak.workload import Workload


class Soak(Workload, Faults, Watch, Verdict):
    """One soak: the fleet, its traffic, its chaos, its watchers and its verdict."""

    async def drive(self) -> None:
        loops: list[Callable[[], Coroutine[Any, Any, None]]] = [
            self.launcher,
            self.resumer,
            self.killer,
            self.chaos,
            self.supervisor,
            self.monitor,
            self.dlq_watch,
            self.progress,
        ]
        self.tasks = [asyncio.create_task(loop(), name=loop.__name__) for loop in loops]
        deadline = self.started + self.cfg.deadline
        while time.monotonic() < deadline:
            for task in self.tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"soak loop {task.get_name()} failed") from task.exception()
            if self.all_done() or self.interrupted:
                break
            await asyncio.sleep(0.5)
        else:
            self.say(f"deadline of {self.cfg.deadline:.0f}s reached")
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def all_done(self) -> bool:
        return len(self.launched) >= self.cfg.runs and self.finished >= len(self.launched)


async def run_soak(cfg: SoakConfig, *, handle_signals: bool = False) -> Report:
    """Run the soak; with `handle_signals` (the command line), SIGINT/SIGTERM stop it early and
    still clean up and report."""
    soak = Soak(cfg)
    failed = True
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(soak, "interrupted", True))
    try:
        await soak.start()
        await soak.drive()
        report = await soak.analyse()
        failed = not report.ok
        return report
    finally:
        await soak.close()
        if soak.own_tmp and not cfg.keep and not failed:
            shutil.rmtree(soak.root, ignore_errors=True)
