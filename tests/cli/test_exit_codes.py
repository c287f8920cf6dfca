"""Exit codes tell the truth (SPEC §10 v2.2), through the real `runfleet` console script with
no fleet: `run` exits 5 when the run ends failed, failed_resumable or cancelled (0 when it ends
finished or paused); a closed pipe (`| head`) ends a command quietly with 0; nats-py's own
connection chatter never reaches the terminal before the clean error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli.runs import RUN_FAILED
from store import RunStatus

ROOT = Path(__file__).resolve().parents[2]
RUNFLEET = Path(sys.executable).parent / "runfleet"


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "data")
    env["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"  # nothing listens there
    env.update(extra)
    return env


def runfleet(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=cli_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("workflow", "status", "code"),
    [
        ("examples/hello.yaml --var name=Ada", "finished", 0),
        ("examples/approval.yaml", "paused_waiting_human", 0),
        ("examples/budget_guard.yaml", "failed_resumable", 5),
        ("tests/runner/workflows/deliberate.yaml", "failed", 5),
    ],
)
def test_run_exits_5_when_the_run_ends_failed_failed_resumable_or_cancelled(
    tmp_path: Path, workflow: str, status: str, code: int
) -> None:
    for args in (("--quiet",), ("--json",)):
        result = runfleet(tmp_path, "run", *workflow.split(), *args)
        assert result.returncode == code, (result.stdout, result.stderr)
        if "--json" in args:
            assert json.loads(result.stdout)["status"] == status  # the run is still printed
        else:
            assert f"status    {status}" in result.stdout


def test_a_cancelled_run_is_a_failed_run_to_runfleet_run() -> None:
    """A local run ends `cancelled` only when someone else cancels it mid-way; what `run` does
    then is this set's answer."""
    assert {RunStatus.FAILED, RunStatus.FAILED_RESUMABLE, RunStatus.CANCELLED} == RUN_FAILED


def closed_pipe(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run `runfleet ARGS` with its stdout a pipe whose reader has already gone (what
    `| head -2` leaves once head has its lines); (exit code, stderr)."""
    proc = subprocess.Popen(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=cli_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before the command has written anything
    with proc.stderr:
        err = proc.stderr.read().decode()
    return proc.wait(timeout=60), err


def test_a_closed_pipe_ends_runs_and_status_quietly_with_exit_0(tmp_path: Path) -> None:
    made = runfleet(tmp_path, "run", "examples/hello.yaml", "--var", "name=Ada", "--json")
    run_id = json.loads(made.stdout)["run_id"]
    for args in (("runs",), ("status", run_id), ("runs", "--json"), ("events", run_id)):
        code, err = closed_pipe(tmp_path, *args)
        assert (code, err) == (0, ""), args


def test_nats_chatter_never_reaches_the_terminal_before_the_clean_error(tmp_path: Path) -> None:
    result = runfleet(tmp_path, "dlq", "list")
    assert result.returncode == 4
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error [nats_unavailable]: cannot reach NATS"), result.stderr
    assert lines[1].startswith("  remedy: ")
    assert len(lines) == 2, result.stderr


def test_a_kubernetes_driver_setting_that_cannot_be_used_is_a_usage_error(tmp_path: Path) -> None:
    result = runfleet(
        tmp_path, "run", "examples/hello.yaml", "--var", "name=Ada", RUNFLEET_SANDBOX="kubernetes"
    )
    assert result.returncode == 2, result.stderr
    assert "RUNFLEET_SANDBOX_IMAGE" in result.stderr
