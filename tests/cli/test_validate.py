"""`runfleet validate FILE` (SPEC v2.2 §10, §6.1): loads and checks a workflow with no fleet and
no store, prints the nodes and edges it understood (and `--json`), and exits 3 on an invalid
file with every problem's file, field and line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.cli.conftest import ROOT, RUNFLEET

BROKEN = """\
name: broken
entry: start
nodes:
  start:
    kind: tool
    run: echo hi
    timeout: -5
  next:
    kind: compute
edges:
  - from: start
    to: nowhere
"""


def validate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`runfleet validate` with no fleet: NATS points nowhere, a setting it does not use is
    unreadable, and RUNFLEET_DATA does not exist (and must not be created)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "data")
    env["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"
    env["RUNFLEET_LEASE_TTL"] = "abc"
    return subprocess.run(
        [str(RUNFLEET), "validate", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_validate_loads_a_workflow_with_no_fleet_and_no_store(tmp_path: Path) -> None:
    result = validate(tmp_path, "examples/approval.yaml")
    assert result.returncode == 0, (result.stdout, result.stderr)
    out = result.stdout
    for node, kind in (("prepare", "compute"), ("review", "human"), ("accepted", "compute")):
        assert any(ln.split()[:2] == [node, kind] for ln in out.splitlines()), out
    assert "review -> accepted  when outputs.review.approved" in out
    assert "review -> rejected  when not outputs.review.approved" in out
    assert not (tmp_path / "data").exists()


def test_validate_json_lists_the_nodes_and_edges_it_understood(tmp_path: Path) -> None:
    result = validate(tmp_path, "examples/approval.yaml", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["valid"] is True and doc["name"] == "approval" and doc["entry"] == "prepare"
    assert [(n["id"], n["kind"]) for n in doc["nodes"]] == [
        ("prepare", "compute"),
        ("review", "human"),
        ("accepted", "compute"),
        ("rejected", "compute"),
    ]
    assert {"from": "review", "to": "accepted", "when": "outputs.review.approved"} in doc["edges"]
    assert doc["unreachable"] == []


def test_validate_of_an_invalid_file_exits_3_naming_file_field_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text(BROKEN)

    result = validate(tmp_path, str(bad))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert f"{bad}:7: nodes.start.timeout" in result.stderr
    assert f"{bad}:8: nodes.next.set" in result.stderr

    as_json = validate(tmp_path, str(bad), "--json")
    assert as_json.returncode == 3
    error = json.loads(as_json.stdout)["error"]
    assert error["code"] == "workflow_invalid" and error["remedy"]
    where = {(p["field"], p["line"]) for p in error["problems"]}
    assert ("nodes.start.timeout", 7) in where and ("nodes.next.set", 8) in where
    assert all(p["file"] == str(bad) for p in error["problems"])
