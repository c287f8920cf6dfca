"""docs/workflows.md is the workflow language's reference (issue 17 item 3): every YAML example
in it is loaded by the real loader (an example whose first line is `# invalid:` must be
refused), every failure code of the engine's enum is in its table, it points at nothing outside
the repository, and the examples it says run do run as it says (through the `runfleet` CLI, with
the `call` module exactly as printed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.errors import WorkflowInvalid
from engine.failures import FailureCode
from engine.loader import load_workflow

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "workflows.md"
RUNFLEET = Path(sys.executable).parent / "runfleet"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(DOC.read_text()) if kind == lang]


def yaml_snippets() -> list[str]:
    return blocks("yaml")


def snippet_id(text: str) -> str:
    match = re.search(r"^name: (\S+)", text, re.MULTILINE)
    return match.group(1) if match else text.splitlines()[0][:30]


def by_name(name: str) -> str:
    [found] = [s for s in yaml_snippets() if snippet_id(s) == name]
    return found


def test_the_doc_has_valid_and_invalid_examples() -> None:
    snippets = yaml_snippets()
    assert len(snippets) >= 10
    assert any(s.startswith("# invalid:") for s in snippets)


@pytest.mark.parametrize("snippet", yaml_snippets(), ids=snippet_id)
def test_every_yaml_snippet_in_the_doc_loads_or_is_marked_invalid(snippet: str) -> None:
    name = f"docs/workflows.md:{snippet_id(snippet)}"
    if snippet.startswith("# invalid:"):
        with pytest.raises(WorkflowInvalid):
            load_workflow(snippet, name)
    else:
        loaded = load_workflow(snippet, name)
        assert loaded.workflow.nodes


def test_every_failure_code_is_in_the_doc() -> None:
    text = DOC.read_text()
    missing = [c.value for c in FailureCode if f"`{c.value}`" not in text]
    assert not missing, missing


def test_the_doc_and_the_readme_point_at_nothing_outside_the_repository() -> None:
    for path in (DOC, ROOT / "README.md"):
        text = path.read_text()
        assert "../" not in text, path
        assert "shared/SPEC" not in text, path
        for target in re.findall(r"\]\(([^)]+)\)", text):
            if target.startswith(("#", "http://", "https://")):
                continue
            assert (path.parent / target.split("#")[0]).exists(), (path, target)
    assert "docs/workflows.md" in (ROOT / "README.md").read_text()


# -- the examples run as the doc says ----------------------------------------------------------


def runfleet(tmp: Path, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp / "data")
    env["PYTHONPATH"] = str(tmp)
    result = subprocess.run(
        [str(RUNFLEET), *args, "--json"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    loaded = json.loads(result.stdout)
    assert isinstance(loaded, dict), result
    return loaded


def run_snippet(tmp: Path, name: str, *args: str) -> dict[str, Any]:
    path = tmp / f"{name}.yaml"
    path.write_text(by_name(name))
    return runfleet(tmp, "run", str(path), *args)


def test_the_call_example_module_runs_as_printed(tmp_path: Path) -> None:
    [module] = blocks("python")
    (tmp_path / "ticket_desk.py").write_text(module)
    run = run_snippet(tmp_path, "tickets")
    assert run["status"] == "finished", run
    opened = run["outputs"]["open"]
    assert re.fullmatch(r"T-\d{5}", opened["ticket"])
    assert opened == {"ticket": opened["ticket"], "title": "printer on fire", "priority": 2}
    assert run["outputs"]["announce"] == f"opened {opened['ticket']} for printer on fire"
    assert run["usage"]["cost_usd"] == pytest.approx(0.002)


def test_quoting_example_passes_the_value_as_one_word(tmp_path: Path) -> None:
    run = run_snippet(tmp_path, "quoting")
    assert run["status"] == "finished", run
    assert run["outputs"]["tell"]["line"] == "1:a b; echo injected"


def test_compute_and_expression_examples_give_the_values_the_doc_shows(tmp_path: Path) -> None:
    compute = run_snippet(tmp_path, "compute_example")
    assert compute["outputs"]["numbers"] == {"squares": [1, 4, 9], "total": 30, "label": "big"}
    exprs = run_snippet(tmp_path, "expressions")["outputs"]["sum_up"]
    assert exprs["nonzero"] == [3, 12] and exprs["biggest"] == 12 and exprs["count"] == 3
    assert exprs["clean_name"] == "report.txt" and exprs["is_text"] is True
    assert exprs["summary"] == "3 files, largest 12"


def test_the_fail_node_example_parks_then_a_raised_cap_finishes_it(tmp_path: Path) -> None:
    parked = run_snippet(tmp_path, "budget_guard")
    assert (parked["status"], parked["failure_code"]) == ("failed_resumable", "BUDGET_GUARD")
    assert parked["restart_node"] == "check"
    done = runfleet(tmp_path, "resume", parked["run_id"], "--local", "--max-iterations", "20")
    assert done["status"] == "finished", done
    assert done["outputs"]["done"] == {"steps": 4}


def test_the_loop_example_takes_the_exit_edge_when_the_marker_exists(tmp_path: Path) -> None:
    path = tmp_path / "poll.yaml"
    path.write_text(by_name("poll_until_ready"))
    marker = tmp_path / "ready.flag"
    marker.write_text("")
    run = runfleet(tmp_path, "run", str(path), "--var", f"marker={marker}")
    assert run["status"] == "finished", run
    assert run["outputs"]["check"] == "yes"
