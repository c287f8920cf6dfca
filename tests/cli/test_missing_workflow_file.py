"""A workflow file named on the command line that is not there is a usage error (SPEC §10:
exit 2, naming the argument and the value) for every command that takes one — `validate` as
`launch`, `run`, `resume --file` and `rewind --file` — not a typed refusal of an invalid
workflow (exit 3, "fix the workflow file at the line shown"): there is no line to fix. Nothing
is opened first: no fleet, no store."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.cli.conftest import CLI_TIMEOUT_S, RUNFLEET

COMMANDS = [
    ("validate", "nope.yaml"),
    ("validate", "nope.yaml", "--json"),
    ("launch", "nope.yaml"),
    ("run", "nope.yaml"),
    ("resume", "01a2321e-d5", "--file", "nope.yaml"),
    ("rewind", "01a2321e-d5", "--node", "x", "--file", "nope.yaml"),
]


def test_a_missing_workflow_file_is_the_same_usage_error_for_every_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "data")
    env["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"
    answers = {}
    for args in COMMANDS:
        result = subprocess.run(
            [str(RUNFLEET), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
        answers[args] = (result.returncode, "'nope.yaml' does not exist" in result.stderr)
    assert answers == {args: (2, True) for args in COMMANDS}
    assert not (tmp_path / "data").exists()
