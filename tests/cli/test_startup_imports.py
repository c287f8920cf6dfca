"""A CLI command imports only what it uses (ADR-0024).

Every command took 2.5-3 s of CPU to start, `runfleet --help` included: the package `__init__`s
imported everything they export, so reading the store also imported nats-py (and aiohttp under
it), aioboto3 and botocore, the console's aiohttp server and the engine's execution. An operator
at a shell, and a script calling `runfleet runs --json` in a loop, paid for it every time.

What is asserted is which modules a command imported (read in the command's own process at
exit), not how long it took: a timing would be a flaky test on a shared VM, and the import set
is what the start-up cost comes from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import ROOT, run_hello_without_fleet

HELLO = ROOT / "examples" / "hello.yaml"

HEAVY = (
    "nats",
    "aioboto3",
    "botocore",
    "aiohttp",
    "kubernetes",
    "runner.console.server",
    "engine.execution",
)
"""What a command that only reads the store, or prints help, must not import."""

PROBE = (
    "import atexit, json, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
    "sys.argv[0] = 'runfleet'\n"
    "from runner.cli.main import cli\n"
    "cli()\n"
)


def imported_by(tmp_path: Path, *args: str) -> set[str]:
    """The modules `runfleet ARGS` had imported when it exited (in its own process)."""
    out = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "data")
    env["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"  # nothing there: never a real fleet
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(out.read_text()))


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(f"{h}.") for h in HEAVY))


@pytest.mark.parametrize(
    "args",
    [("--help",), ("runs", "--help"), ("dlq", "--help"), ("console", "--help"), ("runs",)],
    ids=["help", "runs-help", "dlq-help", "console-help", "runs"],
)
def test_a_command_that_only_reads_or_helps_imports_no_nats_s3_server_or_execution(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    assert heavy_in(imported_by(tmp_path, *args)) == []


def test_status_and_events_of_a_run_import_no_nats_s3_server_or_execution(
    tmp_path: Path,
) -> None:
    run_id = run_hello_without_fleet(tmp_path)

    assert heavy_in(imported_by(tmp_path, "status", run_id)) == []
    assert heavy_in(imported_by(tmp_path, "events", run_id, "--json")) == []
    assert heavy_in(imported_by(tmp_path, "runs", "--json")) == []


def test_the_probe_sees_what_a_command_that_runs_a_workflow_imports(tmp_path: Path) -> None:
    """The probe itself: `run` executes in this process, so it must show the engine."""
    modules = imported_by(tmp_path, "run", str(HELLO), "--json")
    assert "engine.execution" in modules
