"""What `runfleet cancel RUN` tells a person (SPEC §4 Cancel, §5.8): a running run is only
asked to stop — its runner checkpoints and writes `cancelled` on its own time — so the output
says the cancel was requested and how to see it land; a run cancelled at once says so. (`--json`
is unchanged: the run's `cancel_requested` tells a program the same.) Against the session's
embedded fleet (`cancel` reaches a running execution through NATS)."""

from __future__ import annotations

from pathlib import Path

from tests.cli.conftest import HOLD, Up, write_workflow


def test_cancel_of_a_running_run_says_the_cancel_is_requested(fleet: Up, workdir: Path) -> None:
    release = workdir / "release"
    run_id = fleet.launch(write_workflow(workdir, "hold", HOLD), f"release={release}")["run_id"]
    try:
        fleet.wait_status(run_id, "running")

        result = fleet.cli("cancel", run_id)

        assert result.returncode == 0, (result.stdout, result.stderr)
        assert "status    running, cancel requested" in result.stdout
        assert (
            "cancel requested: the runner checkpoints and stops;"
            f" `runfleet status {run_id}` shows when it has"
        ) in result.stdout
        assert fleet.wait_status(run_id, "cancelled")["restart_node"] == "wait"
    finally:
        release.touch()  # whatever happened, the node may end


def test_cancel_of_a_paused_run_says_it_is_cancelled(fleet: Up) -> None:
    run_id = fleet.launch("examples/approval.yaml")["run_id"]
    fleet.wait_status(run_id, "paused_waiting_human")

    result = fleet.cli("cancel", run_id)

    assert result.returncode == 0, (result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    assert "status    cancelled" in lines and lines[-1] == "cancelled", result.stdout
    assert "cancel requested" not in result.stdout
