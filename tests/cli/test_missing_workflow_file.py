"""A workflow file named on the command line that is not there is a usage error (SPEC §10:
exit 2, naming the argument and the value) for every command that takes one — `validate` as
`launch`, `run`, `resume --file` and `rewind --file` — not a typed refusal of an invalid
workflow (exit 3, "fix the workflow file at the line shown"): there is no line to fix. Nothing
is opened first: no fleet, no store."""

from __future__ import annotations

from pathlib import Path

from tests.cli.conftest import runfleet_without_fleet

COMMANDS = [
    ("validate", "nope.yaml"),
    ("validate", "nope.yaml", "--json"),
    ("launch", "nope.yaml"),
    ("run", "nope.yaml"),
    ("resume", "01a2321e-d5", "--file", "nope.yaml"),
    ("rewind", "01a2321e-d5", "--node", "x", "--file", "nope.yaml"),
]


def test_a_missing_workflow_file_is_the_same_usage_error_for_every_command(tmp_path: Path) -> None:
    answers = {}
    for args in COMMANDS:
        result = runfleet_without_fleet(tmp_path, *args, cwd=tmp_path)
        answers[args] = (result.returncode, "'nope.yaml' does not exist" in result.stderr)
    assert answers == {args: (2, True) for args in COMMANDS}
    assert not (tmp_path / "data").exists()
