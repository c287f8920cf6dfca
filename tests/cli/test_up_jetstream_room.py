"""`runfleet up` restarts its nats-server once a JetStream disk that filled has room again
(docs/reliability.md O27 left it "not fixed": a nats-server sizes its store from the disk's
free space when it starts, so after the disk filled and was freed it went on refusing every
publish until someone restarted it by hand, and nothing said so). Real parts: a tmpfs as the
JetStream disk, filled through JetStream itself, then grown."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import nats
import pytest

from runner.jetstream_room import FULL_MARGIN, Room, restart_helps
from tests.cli.conftest import Up, eventually, stop_cleanly

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello.yaml"
MiB = 1024 * 1024
root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)"
)


def _mount(path: Path, size_mib: int, *, remount: bool = False) -> None:
    options = f"{'remount,' if remount else ''}size={size_mib}m"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


async def _fill(url: str) -> int:
    """Publish into a stream of its own until JetStream refuses; how many it stored."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="FILLER", subjects=["filler.>"])
        for stored in range(1_000):
            try:
                await js.publish("filler.x", os.urandom(256 * 1024), timeout=2)
            except (nats.errors.Error, TimeoutError):
                return stored
        raise AssertionError("JetStream never refused a publish on a 6 MiB disk")
    finally:
        await nc.close()


@root_only
def test_up_restarts_its_nats_server_once_a_full_jetstream_disk_has_room_again(
    tmp_path: Path,
) -> None:
    fleet = tmp_path / "fleet"
    store_dir = fleet / "data" / "nats" / "jetstream"
    store_dir.mkdir(parents=True)
    _mount(store_dir, 6)
    try:
        up = Up.start(fleet, runners=1)
        try:
            first = up.launch(HELLO)["run_id"]
            up.wait_status(first, "finished", within=60)
            assert asyncio.run(_fill(up.nats_url)) > 0
            eventually(
                lambda: "JetStream is full" in up.output(),
                within=30,
                what="up saying JetStream is full",
            )
            assert "restarting the server" not in up.output()  # no room yet: no restart
            _mount(store_dir, 64, remount=True)
            eventually(
                lambda: "restarted on port" in up.output() and "with room to store" in up.output(),
                within=60,
                what="up restarting its nats-server",
            )
            after = up.launch(HELLO)["run_id"]
            up.wait_status(after, "finished", within=90)
            logged = (up.data / "logs" / "up.log").read_text()
            assert "JetStream is full" in logged and "free space on the disk holding" in logged
        finally:
            stop_cleanly(up)
    finally:
        subprocess.run(["umount", "-l", str(store_dir)], check=False)


@root_only
def test_up_restarts_its_nats_server_once_a_disk_that_refused_a_write_has_room_again(
    tmp_path: Path,
) -> None:
    """Another file filled the disk before JetStream reached its limit: the stream that met
    the refused write stops storing until a restart, and the server's /healthz says so."""
    fleet = tmp_path / "fleet"
    store_dir = fleet / "data" / "nats" / "jetstream"
    store_dir.mkdir(parents=True)
    _mount(store_dir, 16)
    try:
        up = Up.start(fleet, runners=1)
        try:
            junk = store_dir / "junk"
            free = os.statvfs(store_dir).f_bavail * os.statvfs(store_dir).f_frsize
            with junk.open("wb") as out:
                out.truncate(0)
                out.write(b"\0" * max(0, free - 768 * 1024))
            asyncio.run(_fill(up.nats_url))
            eventually(
                lambda: "JetStream cannot write" in up.output(),
                within=30,
                what="up saying JetStream cannot write",
            )
            assert "no space left on device" in up.output()
            junk.unlink()
            eventually(
                lambda: "with room to store" in up.output(),
                within=60,
                what="up restarting its nats-server",
            )
            after = up.launch(HELLO)["run_id"]
            up.wait_status(after, "finished", within=90)
        finally:
            stop_cleanly(up)
    finally:
        subprocess.run(["umount", "-l", str(store_dir)], check=False)


def test_a_server_with_room_or_a_disk_still_full_is_not_restarted(tmp_path: Path) -> None:
    big = 10**15  # more than any disk here could free
    assert not restart_helps(Room(stored=1 * MiB, limit=100 * MiB), tmp_path)  # has room
    at_limit = Room(stored=big, limit=big + FULL_MARGIN // 2)
    assert at_limit.full and not restart_helps(at_limit, tmp_path)  # the disk cannot lift it
    refused = Room(stored=0, limit=big, write_error="stream write error: no space left")
    assert refused.full
    assert restart_helps(refused, tmp_path)  # this disk has room: a restart mends the stream
    small = Room(stored=1 * MiB, limit=1 * MiB + FULL_MARGIN // 2)
    assert restart_helps(small, tmp_path)  # a limit this disk's free space raises


def test_up_says_when_its_nats_server_hangs_and_when_it_answers_again(tmp_path: Path) -> None:
    """A network drill: a nats-server that hangs (SIGSTOP) is not a dead one, so `up` never
    restarted it and said nothing; commands only timed out, told that `up` restarts a server
    that died."""
    import signal

    from tests.cli.conftest import cmdline

    up = Up.start(tmp_path / "fleet", runners=1)
    try:
        (pid,) = [p for p in up.track() if "nats-server" in cmdline(p)]
        os.kill(pid, signal.SIGSTOP)
        try:
            eventually(
                lambda: "does not answer" in up.output(),
                within=60,
                what="up saying its nats-server hangs",
            )
            assert f"`kill {pid}`" in up.output()
        finally:
            os.kill(pid, signal.SIGCONT)
        eventually(
            lambda: "nats-server answers again" in up.output(),
            within=60,
            what="up saying it answers again",
        )
    finally:
        stop_cleanly(up)
