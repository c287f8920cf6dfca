"""A run `runfleet run` started, resumed without `--local` where no fleet runs: the refusal
named only the fleet (found by a newcomer's walkthrough). It also says how the run was run."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.conftest import ROOT, runfleet_without_fleet


def test_resuming_a_local_run_without_a_fleet_names_resume_local(tmp_path: Path) -> None:
    ran = runfleet_without_fleet(tmp_path, "run", str(ROOT / "examples/approval.yaml"), "--json")
    assert ran.returncode == 0, ran.stderr
    run_id = json.loads(ran.stdout)["run_id"]

    resumed = runfleet_without_fleet(tmp_path, "resume", run_id, "--answer", "approved=yes")

    assert resumed.returncode == 4, resumed.stderr
    assert "error [nats_unavailable]" in resumed.stderr
    assert f"runfleet resume {run_id} --local" in resumed.stderr
