"""SPEC §6.4: answers are strings from `--answer k=v` and typed JSON from `--answers-file`;
the flags win over the file — per field: the file still answers what no flag names.

`test_answer_flags_win_over_the_file.py` asserts this for `resume --local` (in-process), and
`tests/publisher/test_answer_flags_win_over_the_file.py` for the publisher's resume called
directly. This is the operator's path through the fleet: `runfleet resume` as a process
(parsing both options, staging what must be staged, publishing), and a runner of the embedded
fleet applying the answers at its fresh claim. `examples/approval.yaml`'s `approved` answer
picks the branch, so the flag's value must reach the node's output to take the other edge.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.conftest import ROOT, Up


def test_spec_6_4_answer_beats_answers_file_for_the_same_field_through_the_fleet(
    fleet: Up, tmp_path: Path
) -> None:
    launched = fleet.launch(ROOT / "examples" / "approval.yaml")
    run_id = launched["run_id"]
    fleet.wait_status(run_id, "paused_waiting_human")
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"approved": True, "note": "from the file"}))

    fleet.ok("resume", run_id, "--answers-file", str(answers), "--answer", "approved=false")

    run = fleet.wait_status(run_id, "finished", "failed", "failed_resumable")
    assert run["status"] == "finished"
    assert run["outputs"]["review"] == {"approved": False, "note": "from the file"}
    assert "accepted" not in run["outputs"]
    assert run["outputs"]["rejected"] == {"decision": "rejected", "note": "from the file"}
