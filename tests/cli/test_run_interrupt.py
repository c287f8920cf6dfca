"""Ctrl-C during an in-process execution (`runfleet run FILE`, `runfleet resume RUN --local`),
through the real console script with no fleet: the first SIGINT stops the run as an operator
cancel does (SPEC §5.8: it checkpoints and ends `cancelled`) and releases its lease, so `resume
--local` continues it at once instead of answering `run_busy` until the lease lapses. `run` then
exits 5 (SPEC §10 v2.2: it ended cancelled), and `resume --local` as `run` does.

The node blocks on a file the test creates; each wait polls the store with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

from tests.cli.conftest import CLI_TIMEOUT_S, HOLD, ROOT, RUNFLEET, eventually, write_workflow

STARTED_WITHIN_S = 30.0
STOPPED_WITHIN_S = 30.0


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "data")
    env["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"  # nothing listens: no queue is involved
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=cli_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=STOPPED_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"still running {STOPPED_WITHIN_S}s after SIGINT:\n{out}\n{err}"
        ) from None
    return proc.returncode, out, err


def run_docs(tmp_path: Path) -> list[dict[str, Any]]:
    """Every run document, read-only from the SQLite file (empty before it exists)."""
    db = tmp_path / "data" / "runs.db"
    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    try:
        return [json.loads(doc) for (doc,) in conn.execute("SELECT doc FROM runs")]
    except sqlite3.OperationalError:  # the schema is not written yet
        return []
    finally:
        conn.close()


def node_started(tmp_path: Path, run_id: str, attempt: int) -> bool:
    db = tmp_path / "data" / "runs.db"
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    try:
        rows = conn.execute("SELECT doc FROM events WHERE run_id = ?", (run_id,))
        events = [json.loads(doc) for (doc,) in rows]
    finally:
        conn.close()
    return any(e["type"] == "node_started" and e["attempt"] == attempt for e in events)


def running_its_node(tmp_path: Path, proc: subprocess.Popen[str], attempt: int) -> dict[str, Any]:
    """The run once it is `running` at `attempt` with its blocking node started."""

    def probe() -> dict[str, Any] | None:
        assert proc.poll() is None, f"the command exited early: {proc.communicate()}"
        for doc in run_docs(tmp_path):
            if (
                doc["status"] == "running"
                and doc["attempt"] == attempt
                and node_started(tmp_path, doc["run_id"], attempt)
            ):
                return doc
        return None

    return eventually(probe, within=STARTED_WITHIN_S, what=f"the run running at {attempt}")


def the_run(tmp_path: Path, run_id: str) -> dict[str, Any]:
    (doc,) = [d for d in run_docs(tmp_path) if d["run_id"] == run_id]
    return doc


def interrupted_run(tmp_path: Path, release: Path) -> str:
    """`runfleet run HOLD`, Ctrl-C once its node runs; checks what `run` answers."""
    hold = write_workflow(tmp_path, "hold", HOLD)
    proc = start(tmp_path, "run", str(hold), "--var", f"release={release}")
    run = running_its_node(tmp_path, proc, attempt=1)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)

    assert code == 5, (code, out, err)
    run_id = run["run_id"]
    assert "status    cancelled" in out, out
    assert f"runfleet resume {run_id} --local" in out, out
    doc = the_run(tmp_path, run_id)
    assert doc["status"] == "cancelled" and doc.get("lease") is None, doc
    assert doc["checkpoint"]["restart_node"] == "wait", doc
    return str(run_id)


def test_ctrl_c_during_run_cancels_the_run_releases_its_lease_and_exits_5(tmp_path: Path) -> None:
    release = tmp_path / "release"
    run_id = interrupted_run(tmp_path, release)

    release.touch()
    resumed = subprocess.run(
        [str(RUNFLEET), "resume", run_id, "--local", "--json"],
        cwd=ROOT,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert resumed.returncode == 0, (resumed.stdout, resumed.stderr)  # not run_busy
    assert json.loads(resumed.stdout)["status"] == "finished"


def test_ctrl_c_during_resume_local_cancels_the_run_and_exits_5(tmp_path: Path) -> None:
    release = tmp_path / "release"
    run_id = interrupted_run(tmp_path, release)

    proc = start(tmp_path, "resume", run_id, "--local", "--json")
    running_its_node(tmp_path, proc, attempt=2)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)

    assert code == 5, (code, out, err)
    assert json.loads(out)["status"] == "cancelled"  # the run is still printed
    assert f"runfleet resume {run_id} --local" in err, err
    doc = the_run(tmp_path, run_id)
    assert doc["status"] == "cancelled" and doc.get("lease") is None, doc

    release.touch()
    again = start(tmp_path, "resume", run_id, "--local", "--json")
    code, out, err = finish(again)
    assert code == 0 and json.loads(out)["status"] == "finished", (code, out, err)
