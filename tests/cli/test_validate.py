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


WARNED = """\
name: warned
entry: a
nodes:
  a: {kind: compute, set: {n: "1"}}
  b: {kind: compute, set: {n: "2"}}
  left: {kind: compute, set: {n: "3"}}
  right: {kind: compute, set: {n: "4"}}
  stop: {kind: fail, code: STOP, resumable: true}
  c: {kind: compute, set: {n: "5"}}
  d: {kind: compute, set: {n: "6"}}
edges:
  - {from: a, to: b}
  - {from: b, to: a, when: "outputs.b.n == '2'"}
  - {from: b, to: left}
  - {from: b, to: right}
  - {from: left, to: stop}
  - {from: right, to: stop}
  - {from: right, to: c}
  - {from: c, to: d}
  - {from: d, to: c, loop: {name: again, max: 3}}
"""


def test_validate_warns_of_a_resumable_fail_node_without_a_guard_and_an_uncapped_cycle(
    tmp_path: Path,
) -> None:
    """A workflow walkthrough: both loaded `ok` with no word, then a resumable fail node with
    two predecessors ended the run `failed`, and a cycle with no cap ran 1 871 node runs in
    8 s. A capped cycle (`c`, `d`) is not warned about."""
    source = tmp_path / "warned.yaml"
    source.write_text(WARNED)

    result = validate(tmp_path, str(source))
    assert result.returncode == 0, result.stderr
    assert (
        "warning: fail node 'stop' is resumable but has 2 predecessors (a guard needs exactly"
        " one): the run ends failed" in result.stdout
    )
    assert "warning: nodes 'a', 'b' form a cycle with no `loop` cap" in result.stdout
    assert "'c', 'd'" not in result.stdout
    doc = json.loads(validate(tmp_path, str(source), "--json").stdout)
    assert len(doc["warnings"]) == 2

    capped = tmp_path / "capped.yaml"
    capped.write_text(WARNED.replace("name: warned", "name: capped\nbudget: {max_iterations: 50}"))
    assert "form a cycle" not in validate(tmp_path, str(capped)).stdout


def test_validate_warns_of_outputs_naming_a_node_or_vars_naming_a_var_the_workflow_lacks(
    tmp_path: Path,
) -> None:
    """A workflow walkthrough: `{{ outputs.fetchh }}` loaded `ok` and failed
    `EXPRESSION_FAILED` at its node, runs later. A name a node has is not warned about."""
    source = tmp_path / "typo.yaml"
    source.write_text(
        "name: typo\nentry: fetch\nnodes:\n"
        "  fetch: {kind: tool, run: echo 1}\n"
        "  use: {kind: tool, run: 'echo {{ outputs.fetchh }} {{ outputs.fetch }} {{ vars.nme }}'}\n"
        "  ask: {kind: human, message: 'ok {{ vars.x }}?', questions: [{name: ok, type: bool}]}\n"
        "edges:\n  - {from: fetch, to: use}\n  - {from: use, to: ask}\n"
    )

    result = validate(tmp_path, str(source))

    assert result.returncode == 0, result.stderr
    assert (
        "warning: node 'use' names outputs.fetchh, but no node is called 'fetchh': it fails"
        " EXPRESSION_FAILED when it runs" in result.stdout
    )
    assert "outputs.fetch," not in result.stdout
    assert (
        "warning: node 'use' names vars.nme, but the workflow declares no var 'nme' (declared:"
        " none)" in result.stdout
    )
    # A human node's message does not fail: it shows raw and the pause still happens (the
    # warning said EXPRESSION_FAILED; a newcomer's walkthrough).
    assert (
        "warning: the message of node 'ask' names vars.x, but the workflow declares no var 'x'"
        " (declared: none): the message shows raw, unrendered, when the node runs (its stop"
        " still happens)" in result.stdout
    ), result.stdout
