"""The `local` sandbox driver: commands are subprocesses of the runner (SPEC §7.1).

Each command runs as `/bin/sh -c <command>` in a new session, so it leads its own process group
(`sandbox.py`). Every live group is recorded with its pgid and its leader's start time in
`<data_dir>/sandboxes/<run_id>/<token>.json` (`records.py`, `groups.py`), so:

- another execution, in any process on this host, can end them (`stop_others`, §5.3;
  `driver.py`);
- a per-sandbox watchdog process (`python -m engine.sandbox.local <record>`, `watchdog.py`) that
  holds the read end of a pipe from the runner ends them when the pipe reaches EOF: the runner
  died, even by SIGKILL. A normal `stop()` ends the groups and removes the record before closing
  the pipe;
- a recycled pid is never signalled (`groups.group_matches`).

What escapes, on purpose and documented:
- a process that leaves its process group (`setsid`, `setpgid`) is no longer tracked or killed,
  and if it keeps the command's stdout/stderr open its output is cut off after the grace;
- the command env is `spec.env` plus a few host variables (`PATH`, `HOME`, `LANG`, ...), and
  `RUNFLEET_SCRATCH_DIR` / `RUNFLEET_WORKSPACE` (/ `RUNFLEET_ATTACHMENTS_DIR`); nothing else of the
  runner's env leaks in. The driver isolates nothing else (`process_isolated=False`);
- a runner that forks without exec keeps the watchdog's pipe open in the fork.
"""

from engine.sandbox.local.driver import LocalSandboxDriver
from engine.sandbox.local.groups import (
    DEFAULT_KILL_GRACE_S,
    GroupRecord,
    group_matches,
    process_start_time,
    terminate_groups,
)
from engine.sandbox.local.records import SandboxRecord, read_record
from engine.sandbox.local.sandbox import LocalSandbox

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "GroupRecord",
    "LocalSandbox",
    "LocalSandboxDriver",
    "SandboxRecord",
    "group_matches",
    "process_start_time",
    "read_record",
    "terminate_groups",
]
