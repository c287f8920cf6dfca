"""`runfleet up` (SPEC §10, §12, §5.8): the embedded fleet runs launched runs through the queue,
resumes through the queue, follows events until a run settles, restarts a killed runner, and on
Ctrl-C drains its runners (each hands its in-flight runs off) and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runner.config import RunnerSettings
from tests.cli.conftest import (
    HOLD,
    RUNFLEET,
    STOP_WITHIN_S,
    Up,
    alive,
    eventually,
    has_open,
    processes_of,
    write_workflow,
)
from tests.support.frozen_heap import CLI_REPORTING_FROZEN, frozen_at_exit


def test_a_launched_run_is_claimed_by_a_runner_and_finishes(fleet: Up) -> None:
    launched = fleet.launch("examples/hello.yaml", "name=Ada")
    assert launched["status"] in {"queued", "running", "finished"}  # a runner may be quick
    assert launched["attempt"] == 1
    assert launched["origin"] == "fleet"

    done = fleet.wait_status(launched["run_id"], "finished")
    assert done["attempt"] == 1
    assert done["outputs"]["greet"] == "hello Ada"
    assert done["lease"] is None
    claims = [e for e in fleet.events(launched["run_id"]) if e["type"] == "run_claimed"]
    assert [c["data"]["path"] for c in claims] == ["fresh"]


def test_a_paused_run_resumed_with_answers_finishes_through_the_queue(fleet: Up) -> None:
    run_id = fleet.launch("examples/approval.yaml")["run_id"]
    paused = fleet.wait_status(run_id, "paused_waiting_human", "finished", "failed")
    assert paused["status"] == "paused_waiting_human"
    assert [q["name"] for q in paused["pending_questions"]] == ["approved", "note"]

    queued = fleet.ok("resume", run_id, "--answer", "approved=yes", "--answer", "note=ok")
    # Queued for the fleet (a runner may already have claimed it): the CLI did not run it.
    assert queued["status"] in {"queued", "running", "finished"}
    assert queued["attempt"] == 2
    assert queued["origin"] == "fleet"

    done = fleet.wait_status(run_id, "finished", "failed", "failed_resumable")
    assert done["status"] == "finished"
    assert done["attempt"] == 2
    assert done["outputs"]["review"] == {"approved": True, "note": "ok"}
    assert done["outputs"]["accepted"] == {"decision": "approved", "note": "ok"}
    events = fleet.events(run_id)
    queued_kinds = [e["data"]["kind"] for e in events if e["type"] == "run_queued"]
    assert queued_kinds == ["launch", "resume"]
    claims = [(e["attempt"], e["data"]["path"]) for e in events if e["type"] == "run_claimed"]
    assert claims == [(1, "fresh"), (2, "fresh")]  # `--local` would claim on the `local` path
    runners = {e["data"]["runner"] for e in events if e["type"] == "run_claimed"}
    assert all(r in fleet.owners() for r in runners), (runners, fleet.owners())


def test_events_follow_returns_once_the_run_settles_and_includes_run_finished(
    fleet: Up, workdir: Path
) -> None:
    release = workdir / "release"
    run_id = fleet.launch(write_workflow(workdir, "hold", HOLD), f"release={release}")["run_id"]
    follow = subprocess.Popen(
        [str(RUNFLEET), "events", run_id, "--follow", "--json"],
        env=fleet.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Once it has the store open it reads at once: a plain `events` would be gone by the
        # time the next `runfleet status` (a second or more) has seen the run running.
        eventually(
            lambda: follow.poll() is not None or has_open(follow.pid, fleet.data / "runs.db"),
            within=30,
            what="events --follow reading the store",
        )
        fleet.wait_status(run_id, "running")
        assert follow.poll() is None, "events --follow returned while the run was running"
        release.touch()
        out, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
    assert follow.returncode == 0, err
    types = [e["type"] for e in json.loads(out)["events"]]  # one document, at the end
    assert types[0] == "run_launched"
    assert "run_finished" in types
    assert types[-1] == "run_finished"
    assert fleet.status(run_id)["status"] == "finished"


def test_a_killed_runner_process_is_restarted_by_up(fleet: Up) -> None:
    before = fleet.runner_pids()
    assert len(before) == 2, before
    victim = min(before)
    index = next(i for i in range(fleet.runners) if fleet.ready_lines(i)[-1].endswith(f":{victim}"))
    starts = len(fleet.ready_lines(index))

    os.kill(victim, signal.SIGKILL)

    def restarted() -> int | None:
        pids = fleet.runner_pids()
        new = pids - before
        lines = fleet.ready_lines(index)
        if victim in pids or len(pids) != 2 or len(new) != 1 or len(lines) != starts + 1:
            return None
        (pid,) = new
        return pid if lines[-1].endswith(f":{pid}") else None

    new_pid = eventually(restarted, within=30, what="a new runner process")
    assert not alive(victim)
    assert alive(new_pid)


@dataclass
class CtrlC:
    """What a Ctrl-C on `up` left: its exit code and duration, surviving processes, runner
    logs, and the run that was in flight."""

    rc: int
    took: float
    output: str
    seen: set[int]
    leftovers: dict[int, str]
    runner_logs: list[str]
    run: dict[str, Any]
    events: list[dict[str, Any]]


@pytest.fixture(scope="module")
def ctrl_c(tmp_path_factory: pytest.TempPathFactory) -> CtrlC:
    """A fleet of its own with one run in a long tool node, stopped with SIGINT. A short fetch
    timeout makes each runner's fetch loop see the stop before the handoff is done, as it does
    whenever a handoff outlasts a fetch (0.5 s by default)."""
    tmp = tmp_path_factory.mktemp("ctrl_c")
    up = Up.start(
        tmp / "fleet",
        extra={"RUNFLEET_FETCH_TIMEOUT": "0.05s"},
        expect=[(RunnerSettings, "fetch_timeout", timedelta(seconds=0.05))],
    )
    try:
        hold = write_workflow(tmp, "hold", HOLD)
        run_id = up.launch(hold, f"release={tmp / 'never'}")["run_id"]
        running = up.wait_status(run_id, "running")
        assert running["attempt"] == 1
        assert running["lease"] is not None
        eventually(  # the node's shell is alive in the fleet's workspace, under a runner
            lambda: [a for a in processes_of(up.data).values() if "while [ ! -e" in a],
            within=10,
            what="the node's shell process",
        )
        up.track()
        started = time.monotonic()
        rc = up.stop(STOP_WITHIN_S)
        took = time.monotonic() - started
        leftovers = up.leftovers()
    finally:
        up.kill()
    return CtrlC(
        rc=rc,
        took=took,
        output=up.output(),
        seen=set(up.seen),
        leftovers=leftovers,
        runner_logs=[up.runner_log(i) for i in range(up.runners)],
        run=up.ok("status", run_id),  # the store needs no fleet
        events=up.events(run_id),
    )


def test_ctrl_c_on_up_leaves_no_process_behind_and_no_run_stuck_running(ctrl_c: CtrlC) -> None:
    assert ctrl_c.rc == 0, ctrl_c.output
    assert ctrl_c.took < STOP_WITHIN_S  # within the unwind ceiling + 30 s
    assert len(ctrl_c.seen) >= 3, ctrl_c.seen  # nats-server and two runners were children
    assert not ctrl_c.leftovers, ctrl_c.leftovers  # ... and none of them, nor a node, survives

    # Not `running` behind a dead fleet: the drain handed the run off as a new attempt.
    run = ctrl_c.run
    assert run["status"] == "failed_resumable", run
    assert run["failure_code"] == "RUNNER_INTERRUPTED"
    assert run["attempt"] == 2
    assert run["lease"] is None
    queued = [e["data"] for e in ctrl_c.events if e["type"] == "run_queued"]
    assert queued == [{"attempt": 1, "kind": "launch"}, {"attempt": 2, "kind": "handoff"}]


def test_on_ctrl_c_each_runner_drains_and_exits_0(ctrl_c: CtrlC) -> None:
    """SPEC §5.8: SIGTERM → hand off → drain NATS → exit 0. A runner process that exits
    non-zero prints `error [code]: ...` (SPEC §10) into its log, which `up` keeps."""
    for i, text in enumerate(ctrl_c.runner_logs):
        errors = [line for line in text.splitlines() if line.startswith("error [")]
        assert not errors, f"runner-{i} exited with an error on SIGTERM: {errors}"


def test_on_ctrl_c_up_stops_without_waiting_out_the_nats_drain_timeout(ctrl_c: CtrlC) -> None:
    """Handing one run off takes a second or two; nats-py gives up a drain that cannot finish
    (a pull subscription left subscribed) only after 30 s."""
    assert ctrl_c.took < 15, f"`up` took {ctrl_c.took:.1f}s to stop; runner logs:\n" + "\n".join(
        log[-2000:] for log in ctrl_c.runner_logs
    )


def test_up_serves_the_http_api_and_prints_its_url(fleet: Up) -> None:
    """SPEC v2.2 §10: `runfleet up` serves the API too and prints its URL (on 127.0.0.1)."""
    import re
    import urllib.error
    import urllib.request

    def url() -> str | None:
        found = re.search(r"HTTP API on (http://127\.0\.0\.1:\d+)/api/v1", fleet.output())
        return found.group(1) if found else None

    base = eventually(url, within=30, what="the API URL in `up`'s output")
    with urllib.request.urlopen(f"{base}/healthz", timeout=10) as answer:
        assert answer.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/api/v1/runs", timeout=10)
    refused.value.close()  # its socket: an unclosed one is a ResourceWarning (an error here)
    assert refused.value.code == 401  # no token, no access (§10c)


def test_up_freezes_its_startup_heap_once_the_api_listens(tmp_path: Path) -> None:
    """ADR-0016: `up` serves the API (launches, resumes) from its own event loop; a full
    collection over its start-up heap would stall each of them, so it freezes that heap."""
    up = Up.start(tmp_path, runners=1, command=CLI_REPORTING_FROZEN)
    try:
        eventually(lambda: "HTTP API on" in up.output(), within=30, what="the API's URL")
        assert up.stop(STOP_WITHIN_S) == 0, up.output()
    finally:
        up.kill()
    assert frozen_at_exit(up.output()) > 10_000
