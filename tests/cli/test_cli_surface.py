"""The CLI as a person meets it (issue 17 item 7, SPEC §10): every option's `--help` says what
it does, every command's help shows an example, and `runs` lists newest first with the
started-at, duration, workflow and origin of each run and filters by workflow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from runner.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
RUNFLEET = Path(sys.executable).parent / "runfleet"


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    """Every command of the tree, by its path (`dlq list`), groups included."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        full = (*path, name)
        yield " ".join(full), command
        if isinstance(command, click.Group):
            yield from commands(command, full)


COMMANDS = sorted(commands(cli), key=lambda item: item[0])


def test_the_walk_sees_every_command() -> None:
    names = {name for name, _ in COMMANDS}
    assert {"run", "runs", "status", "resume", "dlq list", "dlq purge", "streams ensure"} <= names


@pytest.mark.parametrize(("name", "command"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_option_has_a_description_and_every_command_an_example(
    name: str, command: click.Command
) -> None:
    undocumented = [
        param.opts[0]
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert undocumented == [], f"runfleet {name}: options without --help text: {undocumented}"
    text = command.help or ""
    assert f"runfleet {name}" in text and "Example" in text, (
        f"`runfleet {name} --help` shows no example (an `Example:` line running `runfleet {name}`)"
    )


def test_help_renders_every_example_on_its_own_line() -> None:
    result = subprocess.run(
        [str(RUNFLEET), "runs", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0
    assert any(line.strip().startswith("runfleet runs --") for line in result.stdout.splitlines())


# -- runs: newest first, with the columns an operator scans ------------------------------------


def runfleet(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(data)
    return subprocess.run(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_runs_lists_newest_first_with_started_duration_workflow_origin_and_a_workflow_filter(
    tmp_path: Path,
) -> None:
    made = []
    for args in (
        ("examples/hello.yaml", "--var", "name=Ada"),
        ("examples/budget_guard.yaml",),
        ("examples/hello.yaml", "--var", "name=Bo"),
    ):
        result = runfleet(tmp_path, "run", *args, "--json")
        made.append(json.loads(result.stdout)["run_id"])

    listed = json.loads(runfleet(tmp_path, "runs", "--json").stdout)["runs"]
    assert [r["run_id"] for r in listed] == made[::-1]

    table = runfleet(tmp_path, "runs").stdout.splitlines()
    header = table[0].split()
    for column in ("RUN", "WORKFLOW", "STATUS", "ORIGIN", "STARTED", "DURATION"):
        assert column in header
    assert [line.split()[0] for line in table[1:]] == made[::-1]
    newest = table[1].split()
    assert newest[1:3] == ["hello", "finished"] and "local" in newest
    assert newest[-2].endswith("s")  # its duration, e.g. 0.4s

    only = json.loads(runfleet(tmp_path, "runs", "--workflow", "budget_guard", "--json").stdout)
    assert [r["run_id"] for r in only["runs"]] == [made[1]]

    first = json.loads(runfleet(tmp_path, "runs", "--limit", "1", "--json").stdout)
    older = runfleet(tmp_path, "runs", "--limit", "5", "--after", first["next_after"], "--json")
    assert [r["run_id"] for r in json.loads(older.stdout)["runs"]] == made[1::-1]


@pytest.mark.parametrize(
    "content",
    ['{"n": ' + "9" * 5000 + "}", "[" * 100_000, "\xff not json", '["a list"]'],
)
def test_an_answers_file_that_is_not_a_json_object_is_a_usage_error(
    tmp_path: Path, content: str
) -> None:
    """Found by review: a JSON integer past Python's 4 300-digit limit is a `ValueError` that
    is not a `JSONDecodeError`, and escaped as an internal error. Every unreadable answers
    file is a usage error (exit 2) naming the option."""
    answers = tmp_path / "answers.json"
    answers.write_text(content)
    result = CliRunner().invoke(cli, ["resume", "some-run", "--answers-file", str(answers)])
    assert result.exit_code == 2, result.output
    assert "--answers-file" in result.output
