"""The local driver's per-sandbox watchdog: starting it, and the process itself (SPEC §7.1).

    python -m engine.sandbox.local <record-file> [grace-seconds]

The runner starts one per sandbox with a pipe on its stdin and never writes to it. The watchdog
prints `ready`, then blocks reading the pipe. EOF means the runner closed it: either the runner
died (however it died, the kernel closes its end) and every group still in the record must be
ended, or `stop()` already ended them and removed the record, and there is nothing left to do.
A runner that forks without exec keeps the pipe open in the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.sandbox.errors import SandboxRecordCorrupt, SandboxSetupTimeout, SandboxStartFailed
from engine.sandbox.local.groups import DEFAULT_KILL_GRACE_S, terminate_groups
from engine.sandbox.local.records import read_record

__all__ = ["WATCHDOG_MODULE", "kill_process", "main", "start_watchdog"]

WATCHDOG_MODULE = "engine.sandbox.local"
"""What `python -m` runs: the package's `__main__`, which calls `main` here. (Running this
module itself with `-m` would import it twice: the package imports it first.)"""

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]


async def start_watchdog(
    record: Path, grace_s: float, timeout_s: float
) -> asyncio.subprocess.Process:
    """Start the watchdog of the sandbox recorded at `record` and wait for its `ready`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    try:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", WATCHDOG_MODULE, str(record), str(grace_s)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # a ^C to the runner's group must not reach it first
            cwd="/",
            env=env,
        )
    except OSError as e:
        raise SandboxStartFailed(f"cannot start the sandbox watchdog: {e}") from e
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(timeout_s):
            ready = await proc.stdout.readline()
    except BaseException as e:
        await kill_process(proc)
        if isinstance(e, TimeoutError):
            raise SandboxSetupTimeout(f"the watchdog was not ready in {timeout_s}s") from e
        raise
    if ready != b"ready\n":
        await kill_process(proc)
        raise SandboxStartFailed("the sandbox watchdog exited at start (see the runner's stderr)")
    return proc


async def kill_process(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    if proc.stdin is not None:
        proc.stdin.close()
    await proc.wait()


def _wait_for_eof(fd: int) -> None:
    while os.read(fd, 4096):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The watchdog process: block until the runner's pipe closes, then end what is left."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not 1 <= len(args) <= 2:
        print(f"usage: python -m {WATCHDOG_MODULE} RECORD [GRACE_S]", file=sys.stderr)
        return 2
    record_path = Path(args[0])
    grace_s = float(args[1]) if len(args) == 2 else DEFAULT_KILL_GRACE_S
    # The terminal's ^C / hang-up are for the runner; only the pipe tells this process to act.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # The runner died before it read the greeting: its pipe is already closed, so go
        # straight to the cleanup (quietly: a dead runner is this process's normal cue).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    else:
        _wait_for_eof(sys.stdin.fileno())
    try:
        record = read_record(record_path)
    except SandboxRecordCorrupt as e:
        print(f"runfleet watchdog: {e.message}", file=sys.stderr)
        return 1
    if record is not None:
        terminate_groups(record.groups, grace_s)
        record_path.unlink(missing_ok=True)
    return 0
