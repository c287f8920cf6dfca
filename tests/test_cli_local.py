"""The README's local flow through the real `runfleet` console script (SPEC §10, §5.3 Local).

Every command is a subprocess with `RUNFLEET_DATA` under `tmp_path` (the embedded SQLite store),
run from the repository root so the example paths read as they do in the README. Where a test
must show that a refusal wrote nothing, it reads the store file directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from store import Event, RunDocument, RunQuery
from store.sqlite import SqliteRunStore

ROOT = Path(__file__).resolve().parents[1]
RUNFLEET = Path(sys.executable).parent / "runfleet"
TIMEOUT_S = 60


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return tmp_path / "data"


def runfleet(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(data)
    return subprocess.run(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def ok_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, (result.stdout, result.stderr)
    loaded = json.loads(result.stdout)
    assert isinstance(loaded, dict)
    return loaded


def stored(data: Path, run_id: str) -> tuple[RunDocument, list[Event]]:
    """The run document and its events, read from the store file the CLI wrote."""

    async def read() -> tuple[RunDocument, list[Event]]:
        store = await SqliteRunStore.open(data / "runs.db")
        try:
            return await store.get_run(run_id), await store.read_events(run_id, limit=100_000)
        finally:
            await store.close()

    return asyncio.run(read())


def runs_in(data: Path) -> list[RunDocument]:
    async def read() -> list[RunDocument]:
        store = await SqliteRunStore.open(data / "runs.db")
        try:
            return (await store.list_runs(RunQuery())).runs
        finally:
            await store.close()

    return asyncio.run(read())


def test_the_readme_flow_runs_pauses_resumes_and_shows_status(data: Path) -> None:
    hello = ok_json(runfleet(data, "run", "examples/hello.yaml", "--json"))
    assert hello["status"] == "finished"
    assert hello["outputs"]["greet"] == "hello world"

    paused = ok_json(runfleet(data, "run", "examples/approval.yaml", "--json"))
    assert paused["status"] == "paused_waiting_human"
    assert [q["name"] for q in paused["pending_questions"]] == ["approved", "note"]
    run_id = paused["run_id"]

    done = ok_json(
        runfleet(
            data,
            *("resume", run_id, "--local", "--json"),
            *("--answer", "approved=yes", "--answer", "note=ok"),
        )
    )
    assert done["status"] == "finished"
    assert done["attempt"] == 2
    assert done["outputs"]["review"] == {"approved": True, "note": "ok"}
    assert done["outputs"]["accepted"] == {"decision": "approved", "note": "ok"}

    status = ok_json(runfleet(data, "status", run_id, "--json"))
    for name in (
        "run_id",
        "status",
        "failure_code",
        "error",
        "attempt",
        "workflow",
        "created_at",
        "updated_at",
    ):
        assert name in status, name
    assert status["run_id"] == run_id
    assert status["status"] == "finished"
    assert status["attempt"] == 2
    assert status["workflow"]["name"] == "approval"
    assert status["failure_code"] is None


def test_answers_of_the_wrong_type_are_refused_with_the_field_named_and_nothing_recorded(
    data: Path,
) -> None:
    paused = ok_json(runfleet(data, "run", "examples/approval.yaml", "--json"))
    run_id = paused["run_id"]
    before, events_before = stored(data, run_id)

    plain = runfleet(data, "resume", run_id, "--local", "--answer", "approved=maybe")
    assert plain.returncode == 3, (plain.stdout, plain.stderr)
    assert "approved" in plain.stderr
    assert "answers_invalid" in plain.stderr

    as_json = runfleet(data, "resume", run_id, "--local", "--answer", "approved=maybe", "--json")
    assert as_json.returncode == 3, (as_json.stdout, as_json.stderr)
    error = json.loads(as_json.stdout)["error"]
    assert error["code"] == "answers_invalid"
    assert "approved" in error["message"]
    assert error["remedy"]

    after, events_after = stored(data, run_id)
    assert (after.version, after.status, after.attempt) == (
        before.version,
        before.status,
        before.attempt,
    )
    assert after == before
    assert len(events_after) == len(events_before)


def test_run_of_an_invalid_workflow_exits_3_naming_file_and_line(
    data: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\nentry: a\nnodes:\n  a:\n    kind: tool\n    run: echo hi\n    timeout: soon\n"
    )

    result = runfleet(data, "run", str(bad))

    assert result.returncode == 3, (result.stdout, result.stderr)
    assert f"{bad}:7:" in result.stderr
    assert "nodes.a.timeout" in result.stderr
    error = json.loads(runfleet(data, "run", str(bad), "--json").stdout)["error"]
    assert error["code"] == "workflow_invalid"
    assert f"{bad}:7:" in error["message"]


def test_a_var_of_the_wrong_type_exits_3_naming_the_var(data: Path) -> None:
    result = runfleet(data, "run", "examples/budget_guard.yaml", "--var", "target=many")

    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "target" in result.stderr
    error = json.loads(
        runfleet(data, "run", "examples/budget_guard.yaml", "--var", "target=many", "--json").stdout
    )["error"]
    assert error["code"] == "vars_invalid"
    assert "target" in error["message"]
    assert runs_in(data) == []


ATTACHED = """\
name: attached_local
entry: show
nodes:
  show:
    kind: tool
    run: cat {{ attachments.a.path }} {{ attachments.b.path }}
    output: text
"""


def test_run_attach_gives_a_local_run_its_files_as_launch_does(data: Path, tmp_path: Path) -> None:
    """`runfleet run --attach` (a walkthrough found `run` had no way to give a local run a
    file, although the workflow it develops reads `attachments.*`): the files are promoted to
    the run as a launch's are, the same file name under two attachment names included."""
    source = tmp_path / "attached.yaml"
    source.write_text(ATTACHED)
    for folder, text in (("x", "first\n"), ("y", "second\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "data.csv").write_text(text)

    view = ok_json(
        runfleet(
            data,
            "run",
            str(source),
            "--attach",
            f"a={tmp_path / 'x' / 'data.csv'}",
            "--attach",
            f"b={tmp_path / 'y' / 'data.csv'}",
            "--json",
        )
    )

    assert view["status"] == "finished"
    doc, _ = stored(data, view["run_id"])
    assert doc.checkpoint is not None and doc.checkpoint.outputs["show"] == "first\nsecond"
    assert sorted(a.name for a in doc.attachments) == ["a", "b"]

    missing = runfleet(data, "run", str(source), "--attach", "a=/no/such/file")
    assert missing.returncode == 2 and "no such file" in missing.stderr
