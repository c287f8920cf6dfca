"""One `runfleet up` per data dir (SPEC §10, §12): a second `up` on a data dir whose fleet runs
is a typed refusal (exit 3) that names the dir and the running fleet's pid, and it starts
nothing — no second nats-server on the same JetStream store, no second sweeper over the same
SQLite file, no `nats.url` taken from the fleet every other command finds through it. The
guard is an OS lock: a crashed `up` (SIGKILL) or a stale pid in the lock file never blocks the
next start. And an `up` removes only the `nats.url` it wrote.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from publisher.config import UP_LOCK_FILE
from runner.embedded import EmbeddedFleet
from runner.localnats import NatsServer
from store.url import open_store
from tests.cli.conftest import (
    Up,
    alive,
    eventually,
    processes_of,
    run_to_exit,
    stop_cleanly,
)


def run_up(data: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_to_exit(
        data, ["up", "--runners", "1", "--slots", "2", "--no-view", "--data", str(data)], env
    )


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """The fleet already running: stopped with Ctrl-C at the end, which must still exit 0 and
    leave nothing behind after the refused attempts."""
    up = Up.start(tmp_path_factory.mktemp("first"), runners=1)
    try:
        yield up
    finally:
        stop_cleanly(up)


@pytest.mark.parametrize("nats", ["local", "external"])
def test_second_up_on_same_data_refuses_naming_the_dir_and_the_pid(first: Up, nats: str) -> None:
    """`external`: with RUNFLEET_NATS_URL set, `up` starts no nats-server, but two of them on
    one data dir would still share one SQLite store and run two sweepers: refused alike."""
    url_before = (first.data / "nats.url").read_bytes()
    env = dict(first.env)
    if nats == "external":
        env["RUNFLEET_NATS_URL"] = first.nats_url

    second = run_up(first.data, env)

    assert second.returncode == 3, second.stderr
    err = second.stderr
    assert "error [fleet_already_running]" in err, err
    assert str(first.data.resolve()) in err, err
    pid = first.proc.pid
    assert f"pid {pid}" in err, err
    remedy = err.split("remedy:", 1)[1]
    assert "Ctrl-C" in remedy and f"kill {pid}" in remedy and "--data" in remedy, remedy
    assert "Traceback" not in err

    # The running fleet is untouched: its URL file is whole and still found by the CLI, which
    # still reaches its NATS and its runner.
    assert (first.data / "nats.url").read_bytes() == url_before
    assert (first.data / UP_LOCK_FILE).read_text().strip() == str(pid)
    assert first.proc.poll() is None, first.output()
    run_id = first.launch("examples/hello.yaml", "name=Ada")["run_id"]
    assert first.wait_status(run_id, "finished", "failed")["status"] == "finished"
    assert first.ok("runs")


def test_an_up_killed_with_sigkill_holds_its_dir_while_its_children_run_and_no_longer(
    tmp_path: Path,
) -> None:
    """A SIGKILLed `up` cannot stop anything: its nats-server and runner run on in their own
    sessions, holding the inherited lock, so a new `up` is refused naming them (a second
    nats-server on their JetStream store would corrupt it). Once they are gone the kernel has
    dropped the lock; the lock file (with its dead pid) stays behind and does not refuse."""
    crashed = Up.start(tmp_path, runners=1)
    try:
        crashed.track()
        os.kill(crashed.proc.pid, signal.SIGKILL)
        crashed.proc.wait(timeout=30)
        orphans = processes_of(crashed.data)
        assert orphans, "the crashed fleet's children should still run"

        refused = run_up(crashed.data, crashed.env)

        assert refused.returncode == 3, refused.stderr
        assert "error [fleet_already_running]" in refused.stderr
        assert "processes left by a `runfleet up` that is gone" in refused.stderr
        named = refused.stderr.split("pids ", 1)[1].split(")", 1)[0].split()
        assert sorted(int(p) for p in named) == sorted(orphans), refused.stderr
        # the runners first, the nats-server last: killed in that order, runs are handed off
        assert "nats-server" in orphans[int(named[-1])], (named, orphans)
        assert all("nats-server" not in orphans[int(p)] for p in named[:-1]), (named, orphans)
        # Two steps, not one `kill` of all: the nats-server only once the runners are gone
        # (one kill of both cut their handoff publishes off; a walkthrough).
        runners, server = " ".join(named[:-1]), named[-1]
        assert f"`kill {runners}` (the runners" in refused.stderr, refused.stderr
        assert f"wait until they have exited, then `kill {server}`" in refused.stderr
    finally:
        crashed.kill()  # the nats-server and runner it left in their own sessions
    eventually(lambda: not processes_of(crashed.data), within=30, what="the crashed fleet gone")
    lock = crashed.data / UP_LOCK_FILE
    assert lock.read_text().strip() == str(crashed.proc.pid)
    assert not alive(crashed.proc.pid)

    starts_before = len(crashed.ready_lines(0))
    after = Up.start(tmp_path, runners=1)
    try:
        # Its runner log is appended to: `ready` must mean this fleet's runner, not the last.
        eventually(
            lambda: len(after.ready_lines(0)) > starts_before,
            within=30,
            what="the new fleet's runner consuming",
        )
        assert lock.read_text().strip() == str(after.proc.pid)
    finally:
        stop_cleanly(after)


def test_a_stale_pid_in_the_lock_file_does_not_refuse(tmp_path: Path) -> None:
    """A pid file alone proves nothing: the pid left there may since belong to an unrelated
    live process (here: this test's). Only a held lock refuses."""
    data = tmp_path / "data"
    data.mkdir()
    (data / UP_LOCK_FILE).write_text(f"{os.getpid()}\n")
    up = Up.start(tmp_path, runners=1)
    try:
        assert (data / UP_LOCK_FILE).read_text().strip() == str(up.proc.pid)
    finally:
        stop_cleanly(up)


@pytest.fixture
def own_nats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded fleet starts its own nats-server, as `up` without RUNFLEET_NATS_URL does."""
    for key in [k for k in os.environ if k.startswith("RUNFLEET_")]:
        monkeypatch.delenv(key)


@pytest.mark.usefixtures("own_nats")
@pytest.mark.parametrize("rewritten", [False, True])
async def test_up_removes_only_the_nats_url_it_wrote(tmp_path: Path, rewritten: bool) -> None:
    """On its way out, an `up` removes its own `nats.url` (no command then finds a dead
    server), and leaves one that says anything else: that is another fleet's, and removing it
    would cut that fleet off from the CLI (`nats_unavailable`, with a wrong remedy)."""
    data = tmp_path / "data"
    store = await open_store(f"sqlite:///{tmp_path / 'runs.db'}")
    fleet = EmbeddedFleet(data=data, runners=0, slots=1, store=store)
    try:
        await fleet.start()
        url_file = data / "nats.url"
        assert url_file.read_text().strip() == fleet.nats_url
        if rewritten:
            url_file.write_text("nats://127.0.0.1:4222\n")
    finally:
        await fleet.shutdown(5)
        await store.close()
    if rewritten:
        assert url_file.read_text() == "nats://127.0.0.1:4222\n"
    else:
        assert not url_file.exists()


@pytest.mark.usefixtures("own_nats")
async def test_up_writes_nats_url_only_once_its_streams_take_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nats.url` is what tells a command the fleet takes launches. Written at the server's
    start, a `launch` on a cluster's data dir ran while its streams still elected leaders and
    failed "no stream took the message" (CI on a loaded machine). Here the streams' wait is
    held open: no `nats.url` until it returns."""
    data = tmp_path / "data"
    store = await open_store(f"sqlite:///{tmp_path / 'runs.db'}")
    fleet = EmbeddedFleet(data=data, runners=0, slots=1, store=store)
    entered, release = asyncio.Event(), asyncio.Event()
    real = EmbeddedFleet._ensure_streams

    async def held(self: EmbeddedFleet, js: Any, wire: Any) -> Any:
        entered.set()
        await release.wait()
        return await real(self, js, wire)

    monkeypatch.setattr(EmbeddedFleet, "_ensure_streams", held)
    starting = asyncio.create_task(fleet.start())
    try:
        await asyncio.wait_for(entered.wait(), 30)
        assert not (data / "nats.url").exists()
        release.set()
        await asyncio.wait_for(starting, 30)
        assert (data / "nats.url").read_text().strip() == fleet.nats_url
    finally:
        release.set()
        if not starting.done():
            starting.cancel()
        await fleet.shutdown(5)
        await store.close()


def test_up_on_a_data_dir_it_cannot_write_is_a_usage_error_naming_the_setting(
    tmp_path: Path,
) -> None:
    """An operator walkthrough: a read-only data dir was `error [internal]: OSError(30, ...)`,
    exit 1, naming no path. (Here the dir's parent is a file: root may write anywhere a
    permission would forbid, so a mode cannot make the case.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}

    refused = run_up(blocker / "data", env)

    assert refused.returncode == 2, refused.stderr
    assert "RUNFLEET_DATA=" in refused.stderr and "cannot write there" in refused.stderr
    assert "internal" not in refused.stderr
    assert "--data DIR" in refused.stderr


def test_a_deleted_lock_file_under_a_running_fleet_still_refuses_a_second_up(
    tmp_path: Path,
) -> None:
    """Deleting `up.lock` under a running fleet left its processes holding a file no one sees,
    and a second `up` locked a new one and started a second nats-server on the same JetStream
    store (found by an operator walkthrough). The processes holding the deleted file are the
    fleet: the second `up` is refused naming them and saying the file was deleted."""
    running = Up.start(tmp_path, runners=1)
    try:
        (running.data / UP_LOCK_FILE).unlink()

        refused = run_up(running.data, running.env)

        assert refused.returncode == 3, refused.stderr
        assert "error [fleet_already_running]" in refused.stderr
        assert "up.lock, which was deleted" in refused.stderr
        assert "never delete up.lock" in refused.stderr
        named = {int(p) for p in refused.stderr.split("pids ", 1)[1].split(")", 1)[0].split()}
        assert running.proc.pid in named, refused.stderr
        assert running.proc.poll() is None  # the running fleet is untouched
    finally:
        stop_cleanly(running)


@pytest.mark.usefixtures("own_nats")
def test_a_nats_server_on_the_dirs_jetstream_store_without_the_lock_refuses_a_second_up(
    tmp_path: Path,
) -> None:
    """An `up` of a build before the lock (ADR-0018) holds none: the new `up` started a second
    nats-server on the same JetStream store and took `nats.url` (an upgrade walkthrough). A
    nats-server whose store is under the data dir refuses the new `up`, naming it."""
    data = tmp_path / "data"
    old = NatsServer(data / "nats")  # as the old `up` started it: `-sd DATA/nats/jetstream`
    old.start()
    try:
        refused = run_up(data, {k: v for k, v in os.environ.items()})

        assert refused.returncode == 3, refused.stderr
        assert "error [fleet_already_running]" in refused.stderr
        assert f"holds no up.lock: pids {old.pid}" in refused.stderr
        assert old.running
        assert not (data / "nats.url").exists()
    finally:
        old.stop()
