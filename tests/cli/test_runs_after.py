"""`runfleet runs --after RUN` (SPEC §10) names a run the way every command does: its id or a
unique prefix of at least 6 characters. An id no run has is the typed `run_not_found` refusal
(exit 3) naming it — never a page from wherever the string happens to sort. Through the real
console script, with no fleet (listing needs only the store).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.cli.conftest import runfleet_without_fleet

UNKNOWN = "01ffffff-0000-7000-8000-000000000000"
"""A well-formed run id no run has: it sorts after every run made today, so before the fix it
listed the whole store from the start."""


def runfleet(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return runfleet_without_fleet(tmp_path, *args)


def three_runs(tmp_path: Path) -> list[str]:
    """Three finished local runs, newest first."""
    for name in ("Ada", "Bo", "Cy"):
        made = runfleet(tmp_path, "run", "examples/hello.yaml", "--var", f"name={name}", "--json")
        assert made.returncode == 0, made.stderr
    listed = runfleet(tmp_path, "runs", "--json")
    ids = [r["run_id"] for r in json.loads(listed.stdout)["runs"]]
    assert len(ids) == 3
    return ids


def unique_prefix(run_id: str, others: list[str]) -> str:
    for n in range(6, len(run_id)):
        if not any(o.startswith(run_id[:n]) for o in others if o != run_id):
            return run_id[:n]
    return run_id


def test_runs_after_an_unknown_run_id_is_refused_run_not_found(tmp_path: Path) -> None:
    three_runs(tmp_path)

    human = runfleet(tmp_path, "runs", "--after", UNKNOWN)
    assert human.returncode == 3, (human.stdout, human.stderr)
    assert "run_not_found" in human.stderr and UNKNOWN in human.stderr
    assert human.stdout == ""  # no page

    as_json = runfleet(tmp_path, "runs", "--after", "nope-not-a-run", "--json")
    assert as_json.returncode == 3, (as_json.stdout, as_json.stderr)
    error = json.loads(as_json.stdout)["error"]
    assert error["code"] == "run_not_found" and "nope-not-a-run" in error["message"]


def test_runs_after_resolves_a_prefix_as_every_command_resolves_a_run_id(tmp_path: Path) -> None:
    """A unique prefix pages after its run; a prefix several runs start with is the typed
    `run_id_ambiguous` refusal (before the fix it was compared as a string and listed an empty
    page, every run that starts with it sorting after it)."""
    newest, middle, oldest = three_runs(tmp_path)

    page = runfleet(tmp_path, "runs", "--after", unique_prefix(newest, [middle, oldest]), "--json")
    assert page.returncode == 0, (page.stdout, page.stderr)
    assert [r["run_id"] for r in json.loads(page.stdout)["runs"]] == [middle, oldest]

    shared = next(
        (newest[:n] for n in range(len(newest), 0, -1) if middle.startswith(newest[:n])), ""
    )
    assert len(shared) >= 6, (newest, middle)  # made seconds apart: the same time prefix
    ambiguous = runfleet(tmp_path, "runs", "--after", shared, "--json")
    assert ambiguous.returncode == 3, (ambiguous.stdout, ambiguous.stderr)
    error = json.loads(ambiguous.stdout)["error"]
    assert error["code"] == "run_id_ambiguous" and {newest, middle} <= set(error["candidates"])
