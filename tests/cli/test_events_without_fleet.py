"""`events RUN --deliveries` with no fleet running: the delivery log lives on NATS, the events
in the store. The command prints the events and says the log is missing, rather than exit 4
with nothing (found by an on-call walkthrough; docs/operations.md says `events` reads the
store while no fleet runs)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.conftest import run_hello_without_fleet, runfleet_without_fleet

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello.yaml"


def test_events_with_deliveries_and_no_fleet_prints_the_events_and_says_the_log_is_missing(
    tmp_path: Path,
) -> None:
    run_id = run_hello_without_fleet(tmp_path)

    shown = runfleet_without_fleet(tmp_path, "events", run_id, "--deliveries")

    assert shown.returncode == 0, shown.stderr
    assert "run_finished" in shown.stdout
    assert "note: the delivery log is not shown" in shown.stderr
    as_json = runfleet_without_fleet(tmp_path, "events", run_id, "--deliveries", "--json")
    assert as_json.returncode == 0
    assert "run_finished" in [e["type"] for e in json.loads(as_json.stdout)["events"]]
