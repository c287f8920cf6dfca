"""`--json` (SPEC §10): every command prints one JSON document with the documented fields, and
errors print `{"error": {"code", "message", "remedy"}}` with exit 3 (refused) or 4
(infrastructure unreachable); a usage error exits 2."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from typing import Any

from tests.cli.conftest import Up, eventually

RUN_FIELDS = (
    "run_id",
    "status",
    "failure_code",
    "error",
    "attempt",
    "workflow",
    "created_at",
    "updated_at",
)
EVENT_FIELDS = ("run_id", "seq", "type", "attempt", "execution", "at", "data")


def one_document(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """stdout holds exactly one JSON object (`json.loads` refuses trailing text)."""
    loaded = json.loads(result.stdout)
    assert isinstance(loaded, dict), result.stdout
    return loaded


def ok(fleet: Up, *args: str) -> dict[str, Any]:
    result = fleet.cli(*args, "--json")
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return one_document(result)


def assert_run_shape(run: dict[str, Any]) -> None:
    for name in RUN_FIELDS:
        assert name in run, (name, sorted(run))
    assert isinstance(run["run_id"], str) and run["run_id"]
    assert isinstance(run["status"], str)
    assert isinstance(run["attempt"], int) and run["attempt"] >= 1
    assert isinstance(run["workflow"], dict) and run["workflow"]["name"]
    for stamp in ("created_at", "updated_at"):
        assert datetime.fromisoformat(run[stamp]).utcoffset() is not None  # aware, SPEC §1


def assert_error_shape(result: subprocess.CompletedProcess[str], exit_code: int, code: str) -> None:
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    error = one_document(result)["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["remedy"], str) and error["remedy"]


def test_launch_run_and_status_print_a_run_with_the_documented_fields(fleet: Up) -> None:
    launched = ok(fleet, "launch", "examples/hello.yaml")
    assert_run_shape(launched)
    local = ok(fleet, "run", "examples/hello.yaml", "--quiet")
    assert_run_shape(local)
    assert local["status"] == "finished"
    status = ok(fleet, "status", launched["run_id"])
    assert_run_shape(status)
    assert status["run_id"] == launched["run_id"]


def test_events_prints_an_events_object_of_envelopes(fleet: Up) -> None:
    run_id = ok(fleet, "run", "examples/hello.yaml")["run_id"]
    events = ok(fleet, "events", run_id)
    assert list(events) == ["events"]
    assert events["events"], events
    for event in events["events"]:
        for name in EVENT_FIELDS:
            assert name in event, (name, event)
        assert event["run_id"] == run_id
    assert [e["seq"] for e in events["events"]] == list(range(1, len(events["events"]) + 1))


def test_runs_prints_a_runs_object(fleet: Up) -> None:
    run_id = ok(fleet, "run", "examples/hello.yaml")["run_id"]
    page = ok(fleet, "runs", "--status", "finished", "--limit", "10000")
    assert isinstance(page["runs"], list)
    mine = [r for r in page["runs"] if r["run_id"] == run_id]
    assert len(mine) == 1
    assert_run_shape(mine[0])


def test_dlq_list_prints_a_records_object_with_ids(fleet: Up) -> None:
    seq = fleet.publish_raw(b"\x00 undecodable")

    def listed_with_it() -> dict[str, Any] | None:
        listed = ok(fleet, "dlq", "list")
        return listed if seq in {r["id"] for r in listed["records"]} else None

    try:
        listed = eventually(listed_with_it, within=30, every=0.3, what=f"record {seq} listed")
        assert isinstance(listed["records"], list)
        for record in listed["records"]:
            assert isinstance(record["id"], int)
            assert "reason" in record
        shown = ok(fleet, "dlq", "show", str(seq))
        assert shown["id"] == seq
        assert "body" in shown
    finally:
        purged = ok(fleet, "dlq", "purge", str(seq), "--yes")
    assert purged == {"removed": [seq]}


def test_the_other_commands_print_one_json_document(fleet: Up) -> None:
    run_id = ok(fleet, "run", "examples/approval.yaml")["run_id"]
    cancelled = ok(fleet, "cancel", run_id)
    assert_run_shape(cancelled)
    assert cancelled["status"] == "cancelled"
    rewound = ok(fleet, "rewind", run_id, "--node", "review")
    assert_run_shape(rewound)
    assert rewound["status"] == "paused_operator"
    assert isinstance(rewound["dropped_nodes"], list)
    assert isinstance(ok(fleet, "sweep")["actions"], dict)
    ensured = ok(fleet, "streams", "ensure")
    assert isinstance(ensured["created"], list) and isinstance(ensured["updated"], list)
    collected = ok(fleet, "gc", "--older-than", "3650d")
    assert set(collected) == {"runs", "staged_uploads", "dlq_records", "dlq_records_kept"}


def test_a_refusal_prints_the_error_object_and_exits_3(fleet: Up) -> None:
    run_id = ok(fleet, "run", "examples/hello.yaml")["run_id"]
    refused = fleet.cli("resume", run_id, "--json")  # a finished run does not resume
    assert_error_shape(refused, 3, "run_not_resumable")
    assert ok(fleet, "status", run_id)["attempt"] == 1  # nothing was written


def test_unreachable_nats_prints_the_error_object_and_exits_4(fleet: Up) -> None:
    before = {r["run_id"] for r in ok(fleet, "runs", "--limit", "10000")["runs"]}
    result = fleet.cli(
        "launch", "examples/hello.yaml", "--json", env={"RUNFLEET_NATS_URL": "nats://127.0.0.1:1"}
    )
    assert_error_shape(result, 4, "nats_unavailable")
    after = {r["run_id"] for r in ok(fleet, "runs", "--limit", "10000")["runs"]}
    assert after == before  # nothing was created


def test_a_usage_error_exits_2(fleet: Up) -> None:
    result = fleet.cli("status", "some-run", "--json", "--no-such-option")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "--no-such-option" in result.stderr
    assert result.stdout == ""  # no half-written document
