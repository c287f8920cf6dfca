"""A mistyped SQLite `RUNFLEET_STORE_URL` is a usage error, never a new empty store (SPEC §10
v2.2, §12).

`sqlite:///tmp/x.db` (three slashes) is `tmp/x.db` under the current directory, and a missing
directory or file used to be created on the spot: `runs` then answered "no runs" and `status`
`run_not_found`, hiding the typo. Now an explicit URL's directory must exist for every command,
and a command that only reads refuses a file that does not exist; both are exit 2 naming the
variable, the URL, the resolved path and the accepted forms. The embedded default under
`RUNFLEET_DATA` is still created by whichever command comes first.

Every command is the real `runfleet` console script in its own process group, pointed at a NATS
URL where nothing listens, so no test reaches a fleet.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli.conftest import runfleet_with

ROOT = Path(__file__).resolve().parents[2]
RUNFLEET = Path(sys.executable).parent / "runfleet"
HELLO = ROOT / "examples" / "hello.yaml"
TIMEOUT_S = 60.0
THREE_SLASHES = "sqlite:///relative/path.db"
FOUR_SLASHES = "sqlite:////absolute/path.db"


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str


def runfleet(tmp_path: Path, *args: str, cwd: Path | None = None, **env: str) -> Result:
    """`runfleet ARGS` with only the `RUNFLEET_*` given (and a data dir under `tmp_path`); a
    command that does not end in time is killed with everything it started."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    clean["RUNFLEET_DATA"] = str(tmp_path / "data")
    clean["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"  # nothing there: never a real fleet
    proc = subprocess.Popen(
        [str(RUNFLEET), *args],
        cwd=cwd or tmp_path,
        env={**clean, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"runfleet {' '.join(args)} did not end within {TIMEOUT_S}s:\n{err}")
    return Result(proc.returncode, out, err)


def assert_store_url_usage_error(result: Result, url: str, *mentions: str) -> None:
    assert result.code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("error [settings_invalid]"), result.stderr
    assert f"RUNFLEET_STORE_URL={url}" in result.stderr
    assert THREE_SLASHES in result.stderr and FOUR_SLASHES in result.stderr
    assert "remedy:" in result.stderr
    for mention in mentions:
        assert mention in result.stderr, result.stderr


EVERY_COMMAND = [
    ("runs",),
    ("status", "0123456789ab"),
    ("events", "0123456789ab"),
    ("dlq", "list"),
    ("dlq", "show", "1"),
    ("launch", str(HELLO)),
    ("run", str(HELLO)),
    ("upload", str(HELLO)),
    ("cancel", "0123456789ab"),
    ("gc", "--older-than", "1d", "--yes"),
    ("runner",),
    ("up", "--no-view"),
    ("console", "--port", "0"),
]


@pytest.mark.parametrize("args", EVERY_COMMAND, ids=lambda a: "-".join(a[:2]))
def test_an_explicit_url_whose_directory_is_missing_is_a_usage_error_for_every_command(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    url = f"sqlite:///{missing / 'runs.db'}"
    result = runfleet(tmp_path, *args, RUNFLEET_STORE_URL=url)
    assert_store_url_usage_error(result, url, str(missing / "runs.db"), "does not exist")
    assert not (tmp_path / "nonexistent").exists(), "the missing directory was created"


def test_a_three_slash_url_is_read_relative_to_the_current_directory(tmp_path: Path) -> None:
    """`sqlite:///tmp/x.db` names `tmp/x.db` here; the error shows the path it resolved to."""
    result = runfleet(tmp_path, "launch", str(HELLO), RUNFLEET_STORE_URL="sqlite:///tmp/x.db")
    assert_store_url_usage_error(
        result, "sqlite:///tmp/x.db", str(tmp_path / "tmp" / "x.db"), "three slashes"
    )
    assert not (tmp_path / "tmp").exists()


NEEDS_A_STORE = [
    ("runs",),
    ("status", "0123456789ab"),
    ("events", "0123456789ab"),
    ("events", "0123456789ab", "--deliveries"),
    ("dlq", "list"),
    ("dlq", "show", "1"),
    # These write, but only to runs that are already there: no store means a typo.
    ("resume", "0123456789ab"),
    ("cancel", "0123456789ab"),
    ("rewind", "0123456789ab", "--node", "greet"),
    ("sweep",),
    ("gc", "--older-than", "7d", "--yes"),
    ("dlq", "replay", "1"),
    ("dlq", "purge", "1", "--yes"),
]


@pytest.mark.parametrize("args", NEEDS_A_STORE, ids="-".join)
def test_a_read_only_command_refuses_an_explicit_url_naming_no_store(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    store = tmp_path / "runs.db"
    url = f"sqlite:///{store}"
    result = runfleet(tmp_path, *args, RUNFLEET_STORE_URL=url)
    assert_store_url_usage_error(result, url, f"no store exists at {store}")
    assert not store.exists(), "a command that only reads created the store"
    as_json = runfleet(tmp_path, *args, "--json", RUNFLEET_STORE_URL=url)
    assert as_json.code == 2
    assert '"code": "settings_invalid"' in as_json.stdout and str(store) in as_json.stdout


@pytest.mark.parametrize("relative_dir_exists", [True, False])
def test_a_three_slash_url_whose_absolute_reading_is_a_store_suggests_four_slashes(
    tmp_path: Path, relative_dir_exists: bool
) -> None:
    """The classic slip: `/tmp/x.db` meant, `sqlite:///tmp/x.db` typed."""
    store = tmp_path / "meant" / "runs.db"
    store.parent.mkdir()
    sqlite3.connect(store).close()
    written = str(store).lstrip("/")
    cwd = tmp_path / "cwd"
    (cwd / written).parent.mkdir(parents=True) if relative_dir_exists else cwd.mkdir()
    url = f"sqlite:///{written}"
    result = runfleet(tmp_path, "runs", cwd=cwd, RUNFLEET_STORE_URL=url)
    assert_store_url_usage_error(
        result, url, str(cwd / written), f"did you mean sqlite:///{store}?", "three slashes"
    )
    assert not (cwd / written).exists()


def test_a_command_that_writes_creates_an_explicit_store_in_an_existing_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "stores").mkdir()
    url = "sqlite:///stores/runs.db"  # relative to the command's directory, tmp_path
    uploaded = runfleet(tmp_path, "upload", str(HELLO), RUNFLEET_STORE_URL=url)
    assert uploaded.code == 0, uploaded.stderr
    assert (tmp_path / "stores" / "runs.db").is_file()
    listed = runfleet(tmp_path, "runs", "--json", RUNFLEET_STORE_URL=url)
    assert listed.code == 0, listed.stderr


@pytest.mark.parametrize("args", [("runs",), ("status", "0123456789ab")], ids="-".join)
def test_the_default_store_is_still_created_by_the_first_command_on_a_fresh_machine(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Without `RUNFLEET_STORE_URL`, `$RUNFLEET_DATA/runs.db` and its directories are made by
    whichever command comes first, even one that only reads."""
    data = tmp_path / "fresh" / "data"
    result = runfleet(tmp_path, *args, RUNFLEET_DATA=str(data))
    assert result.code in (0, 3), result.stderr  # `status` of no such run: run_not_found
    assert "settings_invalid" not in result.stderr
    assert (data / "runs.db").is_file()


def test_a_read_that_makes_the_default_store_says_nothing_ran_there(tmp_path: Path) -> None:
    """Found by a newcomer's walkthrough: `runs` from the wrong directory made an empty store
    there and answered an empty table; `status RUN` then said "check the run id with runfleet
    runs", in a circle. The read still works (exit 0, nothing to list), and says where it
    looked and how to find the fleet's data."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "wrong" / ".runfleet")
    listed = runfleet_with(env, "runs")
    assert listed.returncode == 0, listed.stderr
    assert "no run was ever stored under" in listed.stderr and "RUNFLEET_DATA" in listed.stderr

    env["RUNFLEET_DATA"] = str(tmp_path / "other" / ".runfleet")
    status = runfleet_with(env, "status", "01a244fd-3616")
    assert status.returncode == 3, status.stderr
    assert "remedy: no run was ever stored under" in status.stderr


def test_runs_shows_failure_codes_whole_and_refuses_a_code_that_is_none(tmp_path: Path) -> None:
    """Found by a newcomer's walkthrough: the CODE column cut `TOOL_FAILED_TRANSIENT` to
    `TOOL_FAILED_TRANSI`, which pasted into `runs --code` listed nothing, exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / ".runfleet")
    cut = runfleet_with(env, "runs", "--code", "TOOL_FAILED_TRANSI")
    assert cut.returncode == 2, cut.stderr
    assert "TOOL_FAILED_TRANSIENT" in cut.stderr  # the choices are listed
    whole = runfleet_with(env, "runs", "--code", "ATTACHMENT_PATH_UNAVAILABLE")
    assert whole.returncode == 0, whole.stderr
    header = whole.stdout.splitlines()[0]
    assert header.index("ORIGIN") - header.index("CODE") >= len("ATTACHMENT_PATH_UNAVAILABLE") + 2
