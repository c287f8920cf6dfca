"""Ending a timed-out command inside its pod (SPEC §7.2: a node's timeout stops what it started).

Closing an exec's websocket does not end its process: the kubelet logs "Exec session in
container … terminated but process still running!" and the command runs on, writing into the
workspace while the next node runs. The exec subresource has no signal to send, so each command
records the pid of its shell (`pid_prelude`) in the pod's `/tmp` emptyDir (the root filesystem
is read-only, §7.1), and a timed-out command is ended by a second, short exec (`end_script`):
the shell and every descendant, collected through `/proc/<pid>/task/*/children` *before* any of
them dies (a killed parent's children are re-parented and no longer reachable from it), get
SIGTERM, then SIGKILL after `grace_s` for those still there — the local driver's
SIGTERM-then-SIGKILL at a timeout, inside the pod.
"""

from __future__ import annotations

import re

__all__ = ["PID_DIR", "end_script", "pid_file", "pid_prelude"]

PID_DIR = "/tmp/.runfleet-exec"
"""Where each command's shell pid is kept: `/tmp` is an emptyDir (writable under the read-only
root), private to the pod."""

_EXEC_ID = re.compile(r"[a-z0-9]{8,32}")

_END = r"""
f=@PIDFILE@
p=; read -r p 2>/dev/null < "$f" || exit 0
tree() { echo "$1"; for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do tree "$c"; done; }
pids=$(tree "$p")
alive() { for q in $pids; do kill -0 "$q" 2>/dev/null && return 0; done; return 1; }
kill -s TERM $pids 2>/dev/null
i=0
while [ $i -lt @GRACE_TENTHS@ ] && alive; do sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1)); done
kill -s KILL $pids 2>/dev/null
rm -f "$f"
exit 0
"""


def pid_file(exec_id: str) -> str:
    if not _EXEC_ID.fullmatch(exec_id):
        raise ValueError(f"an exec id is 8-32 lowercase letters or digits, not {exec_id!r}")
    return f"{PID_DIR}/{exec_id}.pid"


def pid_prelude(exec_id: str) -> str:
    """The script's first line: its shell's pid, where `end_script` finds it. Best effort: a
    pod whose `/tmp` cannot be written still runs the command (it just cannot be ended)."""
    f = pid_file(exec_id)
    return f"mkdir -p {PID_DIR} 2>/dev/null && echo $$ > {f} 2>/dev/null\ntrap 'rm -f {f}' EXIT\n"


def end_script(exec_id: str, grace_s: float) -> str:
    """A POSIX sh script that ends the command recorded under `exec_id` and all it started:
    SIGTERM, then SIGKILL to what is left after `grace_s`. A command that already ended (no pid
    file, or its pids gone) makes it a no-op; it always exits 0."""
    tenths = max(1, round(grace_s * 10))
    return (
        _END.replace("@PIDFILE@", pid_file(exec_id)).replace("@GRACE_TENTHS@", str(tenths)).strip()
    )
