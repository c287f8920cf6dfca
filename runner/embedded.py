"""The embedded fleet (`runfleet up`, SPEC §10, §12): a local nats-server (unless
`RUNFLEET_NATS_URL` is set), the streams, N runner *processes* (a killed runner must be a
killed process) sharing the SQLite store and filesystem blobs under `RUNFLEET_DATA`, and a live
view. A runner process that dies is restarted. Ctrl-C (or SIGTERM) drains the runners — each
hands its in-flight runs off — then stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from publisher.config import NATS_URL_FILE, WireSettings
from publisher.connection import connect
from publisher.streams import ensure_streams
from publisher.wire import WireNames
from runner.localnats import NatsServer
from store import RunStore

log = logging.getLogger(__name__)
_PORT_LINE = re.compile(rb"slots, http :(\d+)")


@dataclass
class RunnerProcess:
    index: int
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    http_port: int | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)


class EmbeddedFleet:
    def __init__(
        self,
        *,
        data: Path,
        runners: int,
        slots: int,
        store: RunStore,
        env: dict[str, str] | None = None,
    ) -> None:
        self.data = data.resolve()
        self.count = runners
        self.slots = slots
        self.store = store
        self.base_env = dict(env if env is not None else os.environ)
        self.server: NatsServer | None = None
        self.nats_url = ""
        self.procs: list[RunnerProcess] = []
        self.stopping = False
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self.names = WireNames()

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        (self.data / "logs").mkdir(exist_ok=True)
        wire = WireSettings(data=self.data)
        if wire.nats_url:
            self.nats_url = wire.nats_url
        else:
            self.server = NatsServer(self.data / "nats")
            await asyncio.to_thread(self.server.start)
            self.nats_url = self.server.url
            (self.data / NATS_URL_FILE).write_text(self.nats_url + "\n")
        wire = WireSettings(data=self.data, nats_url=self.nats_url)
        self._nc, self._js = await connect(wire, name="runfleet-up")
        self.names = WireNames(wire.namespace)
        await ensure_streams(self._js, self.names, wire)
        for i in range(self.count):
            rp = RunnerProcess(i, self.data / "logs" / f"runner-{i}.log")
            self.procs.append(rp)
            await self._spawn(rp)

    def _env(self) -> dict[str, str]:
        env = dict(self.base_env)
        env["RUNFLEET_DATA"] = str(self.data)
        env["RUNFLEET_NATS_URL"] = self.nats_url
        env.setdefault("RUNFLEET_HTTP_PORT", "0")
        return env

    async def _spawn(self, rp: RunnerProcess) -> None:
        logf = rp.log_path.open("ab")
        try:
            rp.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "runner",
                "runner",
                "--slots",
                str(self.slots),
                env=self._env(),
                stdout=logf,
                stderr=subprocess_stdout(),
                start_new_session=True,  # Ctrl-C reaches `up` only; it drains the runners
            )
        finally:
            logf.close()
        rp.http_port = None
        rp.started_at = time.monotonic()

    # -- supervise ---------------------------------------------------------------------------

    async def supervise(self) -> None:
        """Restart runner processes that die (until the fleet stops)."""
        while not self.stopping:
            for rp in self.procs:
                if rp.proc is not None and rp.proc.returncode is not None and not self.stopping:
                    log.warning(
                        "runner %d exited with %s; restarting", rp.index, rp.proc.returncode
                    )
                    rp.restarts += 1
                    await self._spawn(rp)
                if rp.http_port is None:
                    rp.http_port = _read_port(rp.log_path)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.5)

    # -- view --------------------------------------------------------------------------------

    async def snapshot(self, session: aiohttp.ClientSession) -> dict[str, object]:
        counts = await self.store.status_counts()
        inflight = 0
        deliveries = 0.0
        alive = 0
        for rp in self.procs:
            if rp.http_port is None or rp.proc is None or rp.proc.returncode is not None:
                continue
            try:
                async with session.get(f"http://127.0.0.1:{rp.http_port}/metrics") as resp:
                    text = await resp.text()
            except aiohttp.ClientError:
                continue
            alive += 1
            for line in text.splitlines():
                if line.startswith("runfleet_inflight_runs "):
                    inflight += int(float(line.split()[1]))
                elif line.startswith("runfleet_deliveries_total{"):
                    deliveries += float(line.rsplit(" ", 1)[1])
        return {
            "runs": {str(k): v for k, v in sorted(counts.items())},
            "inflight": inflight,
            "deliveries": deliveries,
            "runners_alive": alive,
            "dlq": await self.dlq_size(),
        }

    async def dlq_size(self) -> int:
        if self._js is None:
            return -1
        try:
            info = await self._js.stream_info(self.names.dlq_stream)
        except NotFoundError:
            return 0
        except Exception:  # noqa: BLE001 - the view shows -1 rather than failing the fleet
            return -1
        return int(info.state.messages)

    # -- stop --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_stop_requested(self) -> None:
        await self._stop.wait()

    async def shutdown(self, grace_s: float) -> None:
        """SIGTERM every runner (each drains and hands off), wait up to `grace_s`, then kill
        what is left; stop the local server last, so the handoffs can still publish."""
        self.stopping = True
        self._stop.set()
        live = [rp.proc for rp in self.procs if rp.proc is not None and rp.proc.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if live:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=grace_s)
            for proc in live:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            with contextlib.suppress(FileNotFoundError):
                (self.data / NATS_URL_FILE).unlink()


def subprocess_stdout() -> int:
    return asyncio.subprocess.STDOUT


def _read_port(path: Path) -> int | None:
    try:
        match = _PORT_LINE.search(path.read_bytes()[-65536:])
    except FileNotFoundError:
        return None
    return int(match.group(1)) if match else None
