"""The local sandbox driver against real processes (SPEC §7.1).

Nothing is mocked: commands are real process groups, the watchdog is a real process, and every
wait is a poll with a deadline on the condition itself (a pid gone, a line printed)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import engine
from engine.sandbox import (
    OUTPUT_CHUNK_BYTES,
    OUTPUT_TAIL_BYTES,
    LocalSandbox,
    LocalSandboxDriver,
    Sandbox,
    SandboxArchiveInvalid,
    SandboxDriver,
    SandboxLost,
    SandboxSpec,
    SandboxStartFailed,
)
from engine.sandbox.local import GroupRecord, group_matches, process_start_time, terminate_groups

GRACE_S = 0.5
DEADLINE_S = 10.0
ROOT = Path(engine.__file__).resolve().parents[1]

StartSandbox = Callable[..., Awaitable[LocalSandbox]]


def _alive(pid: int) -> bool:
    """Whether `pid` is a running process; a zombie (killed, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"


def _same_file(a: str | Path, b: str | Path) -> bool:
    return os.path.samefile(a, b)


async def _eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {DEADLINE_S}s: {what}")
        await asyncio.sleep(0.02)


class _Lines:
    """An `on_output` that collects stdout and lets a test wait for its first line."""

    def __init__(self) -> None:
        self.stdout = bytearray()
        self.chunks: list[tuple[str, bytes]] = []

    async def __call__(self, stream: str, chunk: bytes) -> None:
        self.chunks.append((stream, chunk))
        if stream == "stdout":
            self.stdout += chunk

    async def first_line(self) -> str:
        await _eventually(lambda: b"\n" in self.stdout, "the command printed a line")
        return self.stdout.split(b"\n", 1)[0].decode()


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex}"


@pytest.fixture
def driver(tmp_path: Path) -> LocalSandboxDriver:
    return LocalSandboxDriver(tmp_path / "data", kill_grace_s=GRACE_S)


@pytest.fixture
async def start(tmp_path: Path, run_id: str) -> AsyncIterator[StartSandbox]:
    started: list[LocalSandbox] = []

    async def start(
        driver: LocalSandboxDriver, token: str = "t1", env: dict[str, str] | None = None
    ) -> LocalSandbox:
        spec = SandboxSpec(
            run_id=run_id,
            lease_token=token,
            workspace_dir=tmp_path / token / "workspace",
            scratch_dir=tmp_path / "scratch",
            env=env or {},
            setup_timeout_s=30.0,
        )
        sandbox = await driver.start(spec)
        started.append(sandbox)
        return sandbox

    yield start
    for sandbox in started:
        await sandbox.stop()


async def test_driver_and_sandbox_satisfy_the_protocols(
    driver: LocalSandboxDriver, start: StartSandbox
) -> None:
    sandbox = await start(driver)
    assert isinstance(driver, SandboxDriver)
    assert isinstance(sandbox, Sandbox)
    caps = driver.capabilities
    assert (caps.process_isolated, caps.host_backed_scratch, caps.supports_dir_copy) == (
        False,
        True,
        True,
    )
    assert sandbox.name == f"{sandbox.spec.run_id}-t1"


@pytest.mark.parametrize("exit_code", [0, 1, 75])
async def test_exit_code_is_reported(
    driver: LocalSandboxDriver, start: StartSandbox, exit_code: int
) -> None:
    sandbox = await start(driver)
    result = await sandbox.exec(f"echo out; echo err >&2; exit {exit_code}", timeout_s=30)
    assert result.exit_code == exit_code
    assert not result.timed_out
    assert (result.stdout_tail, result.stderr_tail) == (b"out\n", b"err\n")


async def test_command_group_is_killed_at_timeout(
    driver: LocalSandboxDriver, start: StartSandbox
) -> None:
    sandbox = await start(driver)
    lines = _Lines()
    result = await sandbox.exec("sleep 300 & echo $$ $!; sleep 300", timeout_s=1.0, on_output=lines)
    assert result.timed_out
    assert result.exit_code == -signal.SIGTERM
    assert result.duration_s >= 1.0
    shell, child = (int(p) for p in (await lines.first_line()).split())
    await _eventually(lambda: not _alive(shell) and not _alive(child), "the group is gone")


async def test_background_children_are_killed_at_command_end(
    driver: LocalSandboxDriver, start: StartSandbox
) -> None:
    sandbox = await start(driver)
    lines = _Lines()
    result = await sandbox.exec("sleep 300 & echo $!", timeout_s=30, on_output=lines)
    assert (result.exit_code, result.timed_out) == (0, False)
    child = int(await lines.first_line())
    await _eventually(lambda: not _alive(child), "the background child is gone")


async def test_output_is_streamed_in_bounded_chunks_and_tails_are_bounded(
    driver: LocalSandboxDriver, start: StartSandbox
) -> None:
    sandbox = await start(driver)
    lines = _Lines()
    result = await sandbox.exec("seq 1 100000; echo done >&2", timeout_s=30, on_output=lines)
    expected = "".join(f"{i}\n" for i in range(1, 100001)).encode()
    assert len(expected) > 4 * OUTPUT_TAIL_BYTES
    assert bytes(lines.stdout) == expected
    assert all(0 < len(chunk) <= OUTPUT_CHUNK_BYTES for _, chunk in lines.chunks)
    assert result.stdout_tail == expected[-OUTPUT_TAIL_BYTES:]
    assert result.stderr_tail == b"done\n"


async def test_command_runs_in_workspace_with_scratch_dir_in_env(
    driver: LocalSandboxDriver, start: StartSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNFLEET_TEST_RUNNER_SECRET", "must-not-leak")
    sandbox = await start(driver, env={"GREETING": "hello"})
    result = await sandbox.exec(
        'pwd -P; printf "%s\\n" "$RUNFLEET_SCRATCH_DIR" "$RUNFLEET_WORKSPACE" "$GREETING" '
        '"${RUNFLEET_TEST_RUNNER_SECRET-unset}"',
        timeout_s=30,
    )
    cwd, scratch, workspace, greeting, secret = result.stdout_tail.decode().splitlines()
    assert _same_file(cwd, sandbox.spec.workspace_dir)
    assert scratch == str(sandbox.spec.scratch_dir)
    assert workspace == str(sandbox.spec.workspace_dir)
    assert (greeting, secret) == ("hello", "unset")


async def test_failing_output_callback_stops_the_command(
    driver: LocalSandboxDriver, start: StartSandbox
) -> None:
    sandbox = await start(driver)

    async def refuse(stream: str, chunk: bytes) -> None:
        raise ValueError("consumer failed")

    with pytest.raises(ValueError, match="consumer failed"):
        await sandbox.exec(
            "sleep 300 & echo $! > sleep.pid; echo go; wait", timeout_s=30, on_output=refuse
        )
    child = int((sandbox.spec.workspace_dir / "sleep.pid").read_text())
    await _eventually(lambda: not _alive(child), "the command's group is gone")


async def test_stop_others_stops_other_executions_and_keeps_its_own(
    tmp_path: Path, start: StartSandbox
) -> None:
    first = LocalSandboxDriver(tmp_path / "data", kill_grace_s=GRACE_S)
    second = LocalSandboxDriver(tmp_path / "data", kill_grace_s=GRACE_S)
    old, new = await start(first, "old"), await start(second, "new")
    old_lines, new_lines = _Lines(), _Lines()
    command = "sleep 300 & echo $!; wait"
    old_exec = asyncio.create_task(old.exec(command, timeout_s=600, on_output=old_lines))
    new_exec = asyncio.create_task(new.exec(command, timeout_s=600, on_output=new_lines))
    old_pid, new_pid = int(await old_lines.first_line()), int(await new_lines.first_line())

    assert await second.stop_others(old.spec.run_id, keep_token="new") == [old.name]

    await _eventually(lambda: not _alive(old_pid), "the other execution's command is gone")
    with pytest.raises(SandboxLost):
        await old_exec
    assert not old.record_path.exists()
    assert [ref.token for ref in await first.list_sandboxes()] == ["new"]
    assert _alive(new_pid) and not new_exec.done()
    with pytest.raises(SandboxLost):
        await old.exec("true", timeout_s=30)

    await new.stop()
    await _eventually(lambda: not _alive(new_pid), "the stopped sandbox's command is gone")
    with pytest.raises(SandboxLost):
        await new_exec
    assert await second.stop_others(old.spec.run_id, keep_token="new") == []


async def test_stop_kills_running_commands_and_is_idempotent(
    driver: LocalSandboxDriver, start: StartSandbox
) -> None:
    sandbox = await start(driver)
    lines = _Lines()
    running = asyncio.create_task(
        sandbox.exec("sleep 300 & echo $!; wait", timeout_s=600, on_output=lines)
    )
    child = int(await lines.first_line())
    await sandbox.stop()
    await sandbox.stop()
    assert not _alive(child)
    assert not sandbox.record_path.exists()
    assert await driver.list_sandboxes() == []
    with pytest.raises(SandboxLost):
        await running


_RUNNER = """
import asyncio, sys
from pathlib import Path
from engine.sandbox import LocalSandboxDriver, SandboxSpec

async def main() -> None:
    data = Path(sys.argv[1])
    driver = LocalSandboxDriver(data / "data", kill_grace_s=0.5)
    spec = SandboxSpec(run_id=sys.argv[2], lease_token="t1", workspace_dir=data / "ws",
                       scratch_dir=data / "scratch")
    sandbox = await driver.start(spec)

    async def show(stream: str, chunk: bytes) -> None:
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()

    await sandbox.exec("sleep 300 & echo $!; wait", timeout_s=600, on_output=show)

asyncio.run(main())
"""


async def test_watchdog_kills_groups_when_runner_dies(tmp_path: Path, run_id: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runner = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _RUNNER, str(tmp_path), run_id),
        stdout=asyncio.subprocess.PIPE,
        cwd=tmp_path,
        env=env,
    )
    assert runner.stdout is not None
    try:
        line = await asyncio.wait_for(runner.stdout.readline(), DEADLINE_S)
        child = int(line)
        assert _alive(child)
    finally:
        runner.kill()
        await runner.wait()
    record = LocalSandboxDriver(tmp_path / "data").record_path(run_id, "t1")
    await _eventually(lambda: not _alive(child), "the watchdog ended the dead runner's group")
    await _eventually(lambda: not record.exists(), "the watchdog removed the record")


def test_recorded_start_time_protects_a_recycled_pid() -> None:
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        start_time = process_start_time(proc.pid)
        assert start_time is not None
        ours = GroupRecord(proc.pid, start_time)
        recycled = GroupRecord(proc.pid, start_time - 1)  # same pid, another process's start
        assert group_matches(ours)
        assert not group_matches(recycled)
        terminate_groups([recycled], GRACE_S)
        assert proc.poll() is None
        terminate_groups([ours], GRACE_S)
        assert proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM
        assert not group_matches(ours)
    finally:
        proc.kill()
        proc.wait()


def test_start_time_is_in_clock_ticks_after_boot_as_records_hold_it() -> None:
    """The recorded unit is field 22 of `/proc/<pid>/stat`, not a wall-clock time: a stepped
    clock must not make a live group look recycled, and older records must still compare."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_bytes()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        assert process_start_time(proc.pid) == ticks
    finally:
        proc.kill()
        proc.wait()
    assert process_start_time(proc.pid) is None


def test_group_outliving_its_leader_is_matched_by_its_members() -> None:
    leader = subprocess.Popen(
        ["/bin/sh", "-c", "sleep 300 & echo $!; read _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdin is not None and leader.stdout is not None
    member = int(leader.stdout.readline())
    try:
        start_time = process_start_time(leader.pid)
        assert start_time is not None
        leader.stdin.close()
        leader.wait(timeout=DEADLINE_S)  # the leader is reaped; its pid lives on as the pgid
        leader.stdout.close()
        assert group_matches(GroupRecord(leader.pid, start_time))
        member_start = process_start_time(member)
        assert member_start is not None
        assert not group_matches(GroupRecord(leader.pid, member_start + 1))
        terminate_groups([GroupRecord(leader.pid, start_time)], GRACE_S)
        assert not _alive(member)
    finally:
        if _alive(member):
            os.kill(member, signal.SIGKILL)


async def test_copy_out_and_copy_in_round_trip_a_directory(
    driver: LocalSandboxDriver, start: StartSandbox, tmp_path: Path
) -> None:
    sandbox = await start(driver)
    source = sandbox.spec.workspace_dir / "out"
    (source / "nested").mkdir(parents=True)
    (source / "a.txt").write_text("alpha")
    (source / "nested" / "b.bin").write_bytes(b"\x00\x01")
    archive = tmp_path / "out.tar"
    await sandbox.copy_out(Path("out"), archive)
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["a.txt", "nested", "nested/b.bin"]
    await sandbox.copy_in(archive, Path("restored"))
    restored = sandbox.spec.workspace_dir / "restored"
    assert (restored / "a.txt").read_text() == "alpha"
    assert (restored / "nested" / "b.bin").read_bytes() == b"\x00\x01"


async def test_copy_in_refuses_archives_that_do_not_extract_safely(
    driver: LocalSandboxDriver, start: StartSandbox, tmp_path: Path
) -> None:
    sandbox = await start(driver)
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(SandboxArchiveInvalid):
        await sandbox.copy_in(garbage, Path("x"))
    escaping = tmp_path / "escaping.tar"
    with tarfile.open(escaping, "w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(SandboxArchiveInvalid):
        await sandbox.copy_in(escaping, Path("x"))
    assert not (sandbox.spec.workspace_dir / "escaped.txt").exists()


@pytest.mark.parametrize("run_id", ["../up", "a/b", ""])
async def test_start_refuses_names_that_are_not_path_safe(
    driver: LocalSandboxDriver, tmp_path: Path, run_id: str
) -> None:
    spec = SandboxSpec(
        run_id=run_id, lease_token="t1", workspace_dir=tmp_path / "w", scratch_dir=tmp_path / "s"
    )
    with pytest.raises(SandboxStartFailed) as failed:
        await driver.start(spec)
    assert (failed.value.code, failed.value.failure_code) == (
        "sandbox_start_failed",
        "SANDBOX_START_FAILED",
    )


def test_watchdog_whose_runner_died_before_reading_ready_cleans_up_quietly(tmp_path: Path) -> None:
    """The runner died between spawning the watchdog and reading its greeting: the write hits
    a closed pipe. The watchdog goes straight to its cleanup and exits 0, no traceback."""
    from engine.sandbox.local.watchdog import WATCHDOG_MODULE

    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read "ready"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", WATCHDOG_MODULE, str(tmp_path / "absent.json")],
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 0
    assert b"Traceback" not in proc.stderr
