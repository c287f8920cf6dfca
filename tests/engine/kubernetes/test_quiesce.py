"""The pod-side quiesce before the bank (SPEC §7.3), run for real in a local process tree.

The quiesce runs in a fresh user + PID namespace (`unshare`), like a container: it must never see,
let alone stop, the host's processes.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from engine.sandbox.kubernetes.watch import parse_quiesce_report, quiesce_command, quiesce_script

needs_unshare = pytest.mark.skipif(
    shutil.which("unshare") is None
    or subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"], check=False).returncode != 0,
    reason="needs unprivileged user + PID namespaces (unshare -Urpf)",
)

_TREE = r"""
sleep 300 & a=$!
sh -c 'while :; do :; done' & b=$!
sh -c 'sleep 300 & wait' & c=$!
@RUN@
echo "rc=$?"
for p in $a $b $c; do read -r l < /proc/$p/stat; s=${l##*) }; echo "state ${s%% *}"; done
echo "alive"
"""


def _in_pid_namespace(run: str, quiesce: str) -> subprocess.CompletedProcess[str]:
    """The tree as a pod: PID 1 is the shell that started it (the pause process's place); `run`
    finds the quiesce script in `$Q`."""
    argv = ["unshare", "-Urpf", "--mount-proc", "sh", "-c", _TREE.replace("@RUN@", run)]
    env = {"Q": quiesce, "PATH": "/usr/bin:/bin"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, env=env)


def _states(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.split()[1] for line in result.stdout.splitlines() if line.startswith("state")]


@needs_unshare
def test_quiesce_stops_every_process_of_the_pod_except_its_own() -> None:
    """`quiesce_command` as an exec of its own; the tar runs after it."""
    sh, dash_c, script = quiesce_command()
    result = _in_pid_namespace(f'{sh} {dash_c} "$Q"', script)
    assert _states(result) == ["T", "T", "T"], result
    assert parse_quiesce_report(result.stderr).quiesced, result
    assert "alive" in result.stdout  # PID 1 (the pod's init) was left alone


@needs_unshare
def test_quiesce_as_a_prefix_keeps_the_tar() -> None:
    """`<script>; exec tar ...`: `$$` is the shell that becomes the tar, and it runs."""
    result = _in_pid_namespace('sh -c "$Q; exec echo tar-ran"', quiesce_script("$$"))
    assert "tar-ran" in result.stdout, result
    assert _states(result) == ["T", "T", "T"], result
    assert parse_quiesce_report(result.stderr).quiesced, result


@needs_unshare
def test_quiesce_that_could_not_stop_a_process_reports_unquiesced() -> None:
    """A process the quiesce may not signal (another user's, in the real pod) stays running: a
    `kill` that fails stands in for EPERM, and the report names what was left."""
    result = _in_pid_namespace('sh -c "kill() { return 1; }; $Q"', quiesce_script())
    report = parse_quiesce_report(result.stderr)
    assert not report.quiesced, result
    assert any(" sleep" in u for u in report.unstopped), report
    assert "T" not in _states(result)


def test_quiesce_report_without_done_is_unquiesced() -> None:
    assert not parse_quiesce_report("sh: not found\n").quiesced
    assert not parse_quiesce_report("runfleet-quiesce: no-proc\n").quiesced
    assert parse_quiesce_report("runfleet-quiesce: done unstopped=0\n").quiesced


def test_quiesce_keep_pid_is_a_pid_or_a_variable_never_shell_text() -> None:
    assert "keep=$TAR_PID;" in quiesce_script("$TAR_PID")
    assert "keep=42;" in quiesce_script("42")
    with pytest.raises(ValueError):
        quiesce_script("1; rm -rf /")
