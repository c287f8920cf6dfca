"""`runfleet up`'s live view and the runners' metrics (SPEC §10 `up`, §5.8; issue 17 item 8).

The view lists each runner with its pid, HTTP port, slots in use and runs in flight; the port is
the one the *current* process listens on (a runner's log is appended across restarts, and an
earlier start's port must never be shown). Without a terminal, `up` prints the view every 10 s,
which is what these tests read. The metrics of a real fleet name only real run statuses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from store import RunStatus
from tests.cli.conftest import ROOT, Up, eventually, stop_cleanly

VIEW_WITHIN_S = 40.0  # a view every 10 s, on a loaded 2-core machine
ROW = re.compile(
    r"^  runner (?P<index>\d+)  pid (?P<pid>\d+)  http :(?P<port>\d+)"
    r"  slots (?P<used>\d+)/(?P<slots>\d+) in use  runs in flight (?P<runs>\d+)",
    re.MULTILINE,
)
TRANSIENT = """\
name: always_transient
entry: flaky
nodes:
  flaky:
    kind: tool
    run: exit 75
    retry:
      max: 0
"""


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


def rows(up: Up, *, after: int = 0) -> dict[int, dict[str, int]]:
    """The last row shown for each runner pid in `up`'s output after character `after`."""
    return {
        int(m["pid"]): {k: int(v) for k, v in m.groupdict().items()}
        for m in ROW.finditer(up.output()[after:])
    }


def owner_pid(port: int) -> int:
    """The pid of the runner that answers on `port` (its `/healthz` owner is `host:pid`)."""
    return int(json.loads(http_get(port, "/healthz"))["owner"].rsplit(":", 1)[1])


def test_up_lists_each_runner_with_pid_port_slots_and_runs(fleet: Up) -> None:
    pids = fleet.runner_pids()
    shown = eventually(
        lambda: (r := rows(fleet)) and pids <= set(r) and r,
        within=VIEW_WITHIN_S,
        what="a view row for each runner",
    )
    for pid in pids:
        row = shown[pid]
        assert row["slots"] == 4 and 0 <= row["used"] <= 4 and row["runs"] >= 0
        assert owner_pid(row["port"]) == pid  # the port shown is that process's own


def test_up_shows_the_current_port_of_a_restarted_runner(tmp_path: Path) -> None:
    up = Up.start(tmp_path / "fleet", runners=1)
    try:
        [first] = up.runner_pids()
        eventually(lambda: first in rows(up), within=VIEW_WITHIN_S, what="the first row")
        mark = len(up.output())
        os.kill(first, signal.SIGKILL)
        second = eventually(
            lambda: next(iter(up.runner_pids() - {first}), None),
            within=30,
            what="the restarted runner",
        )
        eventually(lambda: len(up.ready_lines(0)) >= 2, within=30, what="its second start")
        row = eventually(
            lambda: rows(up, after=mark).get(second), within=VIEW_WITHIN_S, what="its row"
        )
        assert owner_pid(row["port"]) == second
        assert "(restarts 1, last: killed by SIGKILL)" in up.output()[mark:]
        # Why, with the time, in `up`'s own log and on its stderr (no view redraws there).
        said = "runner 0: killed by SIGKILL; restarting"
        assert said in (up.data / "logs" / "up.log").read_text()
        assert said in up.output()[mark:]
    finally:
        stop_cleanly(up)


def test_up_restarts_a_runner_after_its_logs_directory_was_deleted(tmp_path: Path) -> None:
    """An operator walkthrough: `rm -rf DATA/logs` under a running fleet, then a runner died;
    its restart failed opening its log file, the supervising task ended silently, and the
    fleet had no runner for good (a launched run stayed `queued`)."""
    up = Up.start(tmp_path / "fleet", runners=1)
    try:
        [first] = up.runner_pids()
        shutil.rmtree(up.data / "logs")
        os.kill(first, signal.SIGKILL)
        eventually(
            lambda: next(iter(up.runner_pids() - {first}), None),
            within=30,
            what="the restarted runner",
        )
        assert (up.data / "logs" / "runner-0.log").exists()
        run_id = up.launch(ROOT / "examples" / "hello.yaml", "name=Ada")["run_id"]
        assert up.wait_status(run_id, "finished", within=60)["status"] == "finished"
    finally:
        stop_cleanly(up)


def test_runner_metrics_label_only_real_statuses(fleet: Up, workdir: Path) -> None:
    wf = workdir / "transient.yaml"
    wf.write_text(TRANSIENT)
    run_id = fleet.launch(wf)["run_id"]
    parked = fleet.wait_status(run_id, "failed_resumable", within=60)
    eventually(
        lambda: fleet.status(run_id)["failure_code"] == "DLQ_PARKED",
        within=60,
        what="the run parked after its last delivery",
    )
    assert parked["run_id"] == run_id

    pids = fleet.runner_pids()
    shown = eventually(
        lambda: (r := rows(fleet)) and pids <= set(r) and r,
        within=VIEW_WITHIN_S,
        what="a view row for each runner",
    )
    statuses: set[str] = set()
    for row in (shown[pid] for pid in pids):
        text = http_get(row["port"], "/metrics")
        assert "_created" not in text
        assert "runfleet_build_info{" in text and "process_cpu_seconds_total" in text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "status" in sample.labels:
                    statuses.add(sample.labels["status"])
    assert "failed_resumable" in statuses  # the nak'd delivery and the park were observed
    assert statuses <= {s.value for s in RunStatus}, statuses
