"""The human prompt on screen (issue 17 item 2, SPEC §6.3 `human_input_requested`, §10): a
paused run shows what it asks (the node's rendered `message` and each question's description)
in `status`, `status --json` and `events`; nothing is pending once the run is cancelled; a
queued `resume` says what it queued."""

from __future__ import annotations

from tests.cli.conftest import Up

ASKS = "Approve this change? Proposed change: bump the version to 1.2.0"


def paused_approval(fleet: Up) -> str:
    run = fleet.ok("run", "examples/approval.yaml")
    assert run["status"] == "paused_waiting_human"
    run_id = run["run_id"]
    assert isinstance(run_id, str)
    return run_id


def test_status_shows_the_rendered_message_and_each_questions_description(fleet: Up) -> None:
    run_id = paused_approval(fleet)

    as_json = fleet.status(run_id)
    assert as_json["prompt"]["node"] == "review"
    assert as_json["prompt"]["message"] == ASKS
    described = {q["name"]: q["description"] for q in as_json["prompt"]["questions"]}
    assert described == {"approved": "approve the change", "note": "anything the record should say"}

    text = fleet.cli("status", run_id)
    assert text.returncode == 0, text.stderr
    assert ASKS in text.stdout
    assert "approve the change" in text.stdout
    assert "anything the record should say" in text.stdout


def test_human_input_requested_carries_the_rendered_message(fleet: Up) -> None:
    run_id = paused_approval(fleet)

    [requested] = [e for e in fleet.events(run_id) if e["type"] == "human_input_requested"]
    assert requested["data"]["message"] == ASKS
    assert requested["data"]["node"] == "review"

    text = fleet.cli("events", run_id)
    assert text.returncode == 0, text.stderr
    [line] = [ln for ln in text.stdout.splitlines() if "human_input_requested" in ln]
    assert ASKS in line and "approve the change" in line


def test_a_cancelled_run_lists_no_pending_questions(fleet: Up) -> None:
    run_id = paused_approval(fleet)
    cancelled = fleet.ok("cancel", run_id)
    assert cancelled["status"] == "cancelled"

    shown = fleet.status(run_id)
    assert shown["pending_questions"] is None and shown["prompt"] is None
    text = fleet.cli("status", run_id)
    assert "waiting for answers" not in text.stdout
    assert ASKS not in text.stdout


def test_resume_of_a_paused_run_says_what_it_queued(fleet: Up) -> None:
    run_id = paused_approval(fleet)

    result = fleet.cli("resume", run_id, "--answer", "approved=yes", "--answer", "note=ship it")
    assert result.returncode == 0, result.stderr
    assert "waiting for answers" not in result.stdout
    [queued] = [ln for ln in result.stdout.splitlines() if ln.startswith("queued")]
    assert "from paused_waiting_human" in queued
    assert "approved=true" in queued and 'note="ship it"' in queued

    done = fleet.wait_status(run_id, "finished")
    assert done["outputs"]["accepted"]["decision"] == "approved"
