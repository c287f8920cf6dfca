"""Runs waiting for a retry look alive (issue 17 item 6, SPEC §5.5, §6.3, §6.6): a `fleet` run
`failed_resumable` with an auto-resumable code between automatic retries shows when the next
delivery comes — "retry in 14 s (delivery 3 of 10, TOOL_FAILED_TRANSIENT)", from its last
`run_retry_scheduled` event and the consumer's `max_deliver` — and `events --follow` keeps
following it until it settles or waits for an operator.

The run is written straight into the embedded SQLite store (the real store the CLI reads), so
the wait between two deliveries is as long as the test needs: no fleet has to hold it there.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from engine.loader import load_workflow_file
from store import Eq, Origin, RunDocument, RunStatus, Update, WorkflowRef, utcnow
from store.sqlite import SqliteRunStore
from tests.cli.conftest import ROOT, RUNFLEET, eventually

RUN_ID = "0123456789abcdef0123456789abcdef"


def cli_env(data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(data)
    env["RUNFLEET_MAX_DELIVER"] = "10"
    return env


def runfleet(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=cli_env(data),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _write_waiting_run(data: Path, *, code: str, origin: Origin, delay: float) -> None:
    """A run as the disposition leaves it after delivery 2 failed transiently (SPEC §5.6)."""
    loaded = load_workflow_file(ROOT / "examples" / "hello.yaml")
    now = utcnow()
    store = await SqliteRunStore.open(data / "runs.db")
    try:
        await store.create_run(
            RunDocument(
                run_id=RUN_ID,
                origin=origin,
                workflow=WorkflowRef(
                    name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
                ),
                status=RunStatus.FAILED_RESUMABLE,
                failure_code=code,
                error="exit 75",
                attempt=1,
                attempt_at=now,
                created_at=now,
                updated_at=now,
            )
        )
        await store.append_event(RUN_ID, "run_claimed", {"path": "fresh"}, attempt=1)
        await store.append_event(
            RUN_ID, "run_retry_scheduled", {"code": code, "delay": 1.0, "delivery": 1}, attempt=1
        )
        await store.append_event(RUN_ID, "run_claimed", {"path": "retry"}, attempt=1)
        await store.append_event(
            RUN_ID, "run_retry_scheduled", {"code": code, "delay": delay, "delivery": 2}, attempt=1
        )
    finally:
        await store.close()


def write_waiting_run(
    data: Path,
    *,
    code: str = "TOOL_FAILED_TRANSIENT",
    origin: Origin = Origin.FLEET,
    delay: float = 600.0,
) -> None:
    data.mkdir(parents=True, exist_ok=True)
    asyncio.run(_write_waiting_run(data, code=code, origin=origin, delay=delay))


async def _settle(data: Path) -> None:
    """The next delivery claims the run and it finishes."""
    store = await SqliteRunStore.open(data / "runs.db")
    try:
        for status, event in ((RunStatus.RUNNING, "run_claimed"), (RunStatus.FINISHED, None)):
            run = await store.get_run(RUN_ID)
            await store.update_run(
                RUN_ID,
                [Eq("version", run.version), Eq("status", run.status)],
                Update(set={"status": status}),
            )
            await store.append_event(RUN_ID, event or "run_finished", {}, attempt=1)
    finally:
        await store.close()


RETRY = re.compile(r"retry in (\d+) s \(delivery 3 of 10, TOOL_FAILED_TRANSIENT\)")


def test_status_of_a_run_between_automatic_retries_says_when_it_retries(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_waiting_run(data)

    text = runfleet(data, "status", RUN_ID)
    assert text.returncode == 0, text.stderr
    found = RETRY.search(text.stdout)
    assert found, text.stdout
    assert 550 <= int(found.group(1)) <= 600

    as_json = runfleet(data, "status", RUN_ID, "--json")
    retry = json.loads(as_json.stdout)["retry"]
    assert retry["code"] == "TOOL_FAILED_TRANSIENT"
    assert (retry["next_delivery"], retry["max_deliver"]) == (3, 10)
    assert 550 <= retry["seconds_left"] <= 600


@pytest.mark.parametrize(
    ("code", "origin"),
    [("DLQ_PARKED", Origin.FLEET), ("TOOL_FAILED_TRANSIENT", Origin.LOCAL)],
)
def test_a_run_no_machinery_will_retry_shows_no_retry(
    tmp_path: Path, code: str, origin: Origin
) -> None:
    data = tmp_path / "data"
    write_waiting_run(data, code=code, origin=origin)
    assert json.loads(runfleet(data, "status", RUN_ID, "--json").stdout)["retry"] is None
    assert "retry in" not in runfleet(data, "status", RUN_ID).stdout


def test_events_follow_keeps_following_a_run_that_will_be_retried(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_waiting_run(data)
    out = tmp_path / "follow.out"
    with out.open("w") as sink:
        follow = subprocess.Popen(
            [str(RUNFLEET), "events", RUN_ID, "--follow"],
            cwd=ROOT,
            env=cli_env(data),
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        eventually(
            lambda: out.read_text().count("run_retry_scheduled") == 2,
            within=30,
            what="the events so far printed",
        )
        # Several polls (0.5 s apart) find nothing new: a follower that treated
        # failed_resumable as settled would have exited after the first.
        with pytest.raises(subprocess.TimeoutExpired):
            follow.wait(timeout=3)

        asyncio.run(_settle(data))
        assert follow.wait(timeout=30) == 0, out.read_text()
        assert "run_finished" in out.read_text()
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()


def test_events_follow_stops_at_a_run_that_waits_for_an_operator(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_waiting_run(data, code="DLQ_PARKED")
    result = subprocess.run(
        [str(RUNFLEET), "events", RUN_ID, "--follow"],
        cwd=ROOT,
        env=cli_env(data),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("run_retry_scheduled") == 2
