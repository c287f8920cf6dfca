"""The local driver's per-sandbox watchdog process (SPEC §7.1).

    python -m engine.sandbox.watchdog <record-file> [grace-seconds]

The runner starts one per sandbox with a pipe on its stdin and never writes to it. The watchdog
prints `ready`, then blocks reading the pipe. EOF means the runner closed it: either the runner
died (however it died, the kernel closes its end) and every group still in the record must be
ended, or `stop()` already ended them and removed the record, and there is nothing left to do.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.sandbox.errors import SandboxRecordCorrupt
from engine.sandbox.local import DEFAULT_KILL_GRACE_S, read_record, terminate_groups


def _wait_for_eof(fd: int) -> None:
    while os.read(fd, 4096):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m engine.sandbox.watchdog RECORD [GRACE_S]", file=sys.stderr)
        return 2
    record_path = Path(args[0])
    grace_s = float(args[1]) if len(args) == 2 else DEFAULT_KILL_GRACE_S
    # The terminal's ^C / hang-up are for the runner; only the pipe tells this process to act.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
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


if __name__ == "__main__":
    raise SystemExit(main())
