"""SPEC §6.4 at the operator surface: `runfleet resume RUN --answer k=v … --answers-file F`
— for the same question, the flags win over the file.

An operator who keeps a standing answers file and corrects one answer on the command line
must get the correction. The audit let the file win and no test noticed. This runs the real
`runfleet` (a local run and a local resume, no fleet needed) on `examples/approval.yaml`,
whose `approved` answer picks the branch.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.conftest import ROOT, runfleet_without_fleet


def test_spec_6_4_answer_flags_win_over_the_answers_file_for_the_same_question(
    tmp_path: Path,
) -> None:
    ran = runfleet_without_fleet(
        tmp_path, "run", str(ROOT / "examples" / "approval.yaml"), "--json"
    )
    assert ran.returncode == 0, ran.stderr
    paused = json.loads(ran.stdout)
    assert paused["status"] == "paused_waiting_human"
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"approved": True, "note": "from the file"}))

    resumed = runfleet_without_fleet(
        tmp_path,
        "resume",
        paused["run_id"],
        "--local",
        "--answers-file",
        str(answers),
        "--answer",
        "approved=false",
        "--answer",
        "note=from a flag",
        "--json",
    )

    assert resumed.returncode == 0, resumed.stderr
    run = json.loads(resumed.stdout)
    assert run["status"] == "finished"
    assert run["outputs"]["review"] == {"approved": False, "note": "from a flag"}
    assert run["outputs"]["rejected"]["decision"] == "rejected"
