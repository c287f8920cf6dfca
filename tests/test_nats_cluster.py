"""The fleet's wire on a three-node JetStream cluster (SPEC §3: replicas 3 in production; §11):
every stream and consumer `ensure_streams` creates is replicated on all three servers, and the
client given the cluster's server list (`RUNFLEET_NATS_URL`, comma-separated) carries on
through the loss of the server it was connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import JetStreamContext
from nats.js.api import PubAck, StreamInfo

from publisher.config import WireSettings
from publisher.connection import connect
from publisher.streams import ensure_streams
from publisher.wire import HDR_MSG_ID, WireNames
from tests.support.nats_cluster import Cluster, leader_other_than, nats_cluster

__all__ = ["nats_cluster"]  # the module-scoped fixture, imported for this module's tests

T = TypeVar("T")

pytestmark = [pytest.mark.timeout(90), pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[1]
RUNFLEET = Path(sys.executable).parent / "runfleet"


def wire(cluster: Cluster, namespace: str) -> WireSettings:
    return WireSettings(nats_url=cluster.url, namespace=namespace, stream_replicas=3)


def test_nats_url_accepts_a_comma_separated_server_list() -> None:
    s = WireSettings(nats_url=" nats://127.0.0.1:1 ,nats://127.0.0.1:2,, nats://127.0.0.1:3")
    assert s.nats_servers() == ["nats://127.0.0.1:1", "nats://127.0.0.1:2", "nats://127.0.0.1:3"]
    assert WireSettings(nats_url="nats://h:4222").nats_servers() == ["nats://h:4222"]
    with pytest.raises(ValueError, match="no server"):
        WireSettings(nats_url=" , ").nats_servers()


async def test_the_cluster_is_three_ready_servers_with_a_meta_leader(
    nats_cluster: Cluster,
) -> None:
    assert [nats_cluster.health(k) for k in range(3)] == ["ok"] * 3
    async with nats_cluster.client() as (_, js):
        info = await js.account_info()  # answered only through a meta leader
        assert info.limits is not None


async def test_ensure_streams_creates_every_stream_and_consumer_with_three_replicas(
    nats_cluster: Cluster, nats_prefix: str
) -> None:
    settings = wire(nats_cluster, nats_prefix)
    nc, js = await connect(settings, name="test-ensure")
    try:
        report = await ensure_streams(js, WireNames(nats_prefix), settings)
        streams = [name for name in report.created if "/" not in name]
        consumers = [name.split("/") for name in report.created if "/" in name]
        assert len(streams) >= 3 and len(consumers) >= 2, report
        for stream in streams:
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert info.cluster is not None and info.cluster.leader, stream
            peers = {p.name for p in info.cluster.replicas or []} | {info.cluster.leader}
            assert peers == {"n1", "n2", "n3"}, (stream, info.cluster)
        for stream, consumer in consumers:
            cinfo = await js.consumer_info(stream, consumer)
            assert cinfo.cluster is not None and cinfo.cluster.leader, consumer
            peers = {p.name for p in cinfo.cluster.replicas or []} | {cinfo.cluster.leader}
            assert peers == {"n1", "n2", "n3"}, (consumer, cinfo.cluster)
        again = await ensure_streams(js, WireNames(nats_prefix), settings)
        assert (again.created, again.updated) == ([], [])  # idempotent on the cluster too
    finally:
        await nc.close()


async def test_the_dlq_is_listed_on_r3_streams_through_a_consumer_it_then_deletes(
    nats_cluster: Cluster, nats_prefix: str
) -> None:
    """`DlqStore.list` reads through an ephemeral consumer (one server, in memory) on the
    replicated DLQ stream: the records come back, and no consumer is left on the stream."""
    from publisher.dlq import DlqStore

    settings = wire(nats_cluster, nats_prefix)
    names = WireNames(nats_prefix)
    nc, js = await connect(settings, name="test-dlq-list")
    try:
        await _until_answered(lambda: ensure_streams(js, names, settings), within=15)
        async with nats_cluster.client() as (watcher, _):
            await leader_other_than(watcher, names.dlq_stream, None, exclude=None)
        dlq = DlqStore(js, names, None)
        for record_id in (4, 2, 9):
            await dlq.put(
                seq=record_id, body=b"{}", headers={}, reason="malformed", replayable=False
            )
        assert [r.id for r in await dlq.list()] == [2, 4, 9]
        assert await js.consumers_info(names.dlq_stream) == []
    finally:
        await nc.close()


async def test_a_paused_stream_leader_is_replaced_and_catches_up_when_resumed(
    nats_cluster: Cluster, nats_prefix: str
) -> None:
    """SIGSTOP (a stalled server, its sockets open): the other two elect a leader and take
    publishes; after SIGCONT the node catches up (its `/healthz` is ok again)."""
    settings = wire(nats_cluster, nats_prefix)
    names = WireNames(nats_prefix)
    nc, js = await connect(settings, name="test-pause")
    try:
        await ensure_streams(js, names, settings)
    finally:
        await nc.close()
    paused = await nats_cluster.leader_of(names.runs_stream)
    nats_cluster.pause(paused)
    try:
        async with nats_cluster.client() as (nc2, js2):  # the other two only
            new = await leader_other_than(
                nc2, names.runs_stream, None, exclude=nats_cluster.name(paused)
            )
            assert nats_cluster.index_of(new) != paused
            ack = await _publish_until_acked(js2, names.runs_subject, b"x", "p:1", within=15)
            assert ack.seq == 1
    finally:
        nats_cluster.resume(paused)
    await asyncio.to_thread(nats_cluster.wait_ready, [paused])
    assert nats_cluster.health(paused) == "ok"


async def test_the_client_continues_on_another_server_when_its_server_is_killed(
    nats_cluster: Cluster, nats_prefix: str
) -> None:
    settings = wire(nats_cluster, nats_prefix)
    names = WireNames(nats_prefix)
    nc, js = await connect(settings, name="test-failover")
    killed: int | None = None
    try:
        # The test before may have left a node rejoining: the API can answer 503 a moment.
        await _until_answered(lambda: ensure_streams(js, names, settings), within=15)
        psub = await js.pull_subscribe_bind(names.consumer, stream=names.runs_stream)
        await _publish_until_acked(js, names.runs_subject, b"before", "m:1", within=15)
        assert nc.connected_url is not None
        killed = nats_cluster.index_of_url(nc.connected_url.geturl())
        await asyncio.to_thread(nats_cluster.kill, killed)

        deadline = time.monotonic() + 15
        while not (
            nc.is_connected
            and nc.connected_url is not None
            and nats_cluster.index_of_url(nc.connected_url.geturl()) != killed
        ):
            assert time.monotonic() < deadline, "the client did not move to another server"
            await asyncio.sleep(0.02)  # the pause between two polls, not a synchronisation
        # A publish right after a leader loss may time out while the stream elects; its retry
        # carries the same msg id, so a stored first try answers as a duplicate, never twice.
        ack = await _publish_until_acked(js, names.runs_subject, b"after", "m:2", within=15)
        info = await _until_answered(lambda: js.stream_info(names.runs_stream), within=15)
        assert info.state.messages == 2 and ack.seq == 2
        got = await _until_answered(lambda: psub.fetch(2, timeout=10), within=20)
        assert sorted(m.data for m in got) == [b"after", b"before"]
        for m in got:
            await m.ack_sync()
    finally:
        await nc.close()
        if killed is not None:
            await asyncio.to_thread(nats_cluster.restart, killed)


async def _until_answered(ask: Callable[[], Awaitable[T]], *, within: float) -> T:
    """A JetStream API request right after a leader loss may answer 503 (or nothing) while the
    stream elects: ask again until it answers, within a deadline."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await ask()
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)  # the pause between two tries, not a synchronisation


async def _publish_until_acked(
    js: JetStreamContext, subject: str, data: bytes, msg_id: str, *, within: float
) -> PubAck:
    deadline = time.monotonic() + within
    while True:
        try:
            return await js.publish(subject, data, headers={HDR_MSG_ID: msg_id}, timeout=2)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)  # the pause between two tries, not a synchronisation


def test_up_with_a_nats_cluster_runs_a_launched_run_on_r3_streams(tmp_path: Path) -> None:
    """`runfleet up --nats-cluster 3`: three local servers, the streams at three replicas,
    runners given all three URLs; a launched run finishes; Ctrl-C leaves no server behind."""
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(data)
    out = (tmp_path / "up.out").open("wb")
    up = subprocess.Popen(
        [str(RUNFLEET), "up", "--nats-cluster", "3", "--runners", "1", "--no-view"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _poll(lambda: "slots, http :" in _read(data / "logs" / "runner-0.log"), up, tmp_path)
        urls = (data / "nats.url").read_text().strip().split(",")
        assert len(urls) == 3 and all(u.startswith("nats://127.0.0.1:") for u in urls)
        launched = _cli(env, "launch", "examples/hello.yaml", "--json")
        run_id = json.loads(launched)["run_id"]
        _poll(lambda: '"finished"' in _cli(env, "status", run_id, "--json"), up, tmp_path)
        info = asyncio.run(_runs_stream_info(urls))
        assert info.config.num_replicas == 3 and info.cluster is not None
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(timeout=45) == 0, _read(tmp_path / "up.out")
        servers = [p for p in _pids_with(str(data)) if p != up.pid]
        assert servers == [], "nats-servers left behind"
    finally:
        out.close()
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        for pid in _pids_with(str(data)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _runs_stream_info(urls: list[str]) -> StreamInfo:
    nc = await nats.connect(servers=urls)
    try:
        return await nc.jetstream().stream_info(WireNames().runs_stream)
    finally:
        await nc.close()


def _cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(RUNFLEET), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def _poll(ok: Callable[[], bool], up: subprocess.Popen[bytes], tmp: Path) -> None:
    deadline = time.monotonic() + 40
    while not ok():
        assert up.poll() is None, f"`runfleet up` exited:\n{_read(tmp / 'up.out')}"
        assert time.monotonic() < deadline, f"not within 40 s:\n{_read(tmp / 'up.out')}"
        time.sleep(0.2)  # the pause between two polls, not a synchronisation


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _pids_with(text: str) -> list[int]:
    """Processes whose command line mentions `text` (the fleet's data directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(proc.name))
    return found


def test_up_refuses_a_nats_cluster_when_a_nats_url_is_set(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env.update(RUNFLEET_DATA=str(tmp_path / "data"), RUNFLEET_NATS_URL="nats://127.0.0.1:1")
    done = subprocess.run(
        [str(RUNFLEET), "up", "--nats-cluster", "3", "--no-view"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "unset RUNFLEET_NATS_URL" in done.stderr, done


async def test_a_runner_started_while_the_consumer_has_no_leader_waits_for_the_election(
    nats_cluster: Cluster, nats_prefix: str, tmp_path: Path
) -> None:
    """Its start-up check of the consumer is waited out across a leader election instead of
    exiting 4 (a container restart loop in Kubernetes)."""
    from engine.sandbox.local import LocalSandboxDriver
    from runner.config import RunnerSettings
    from runner.runner import Runner
    from store.sqlite import SqliteRunStore

    settings = wire(nats_cluster, nats_prefix)
    names = WireNames(nats_prefix)
    nc, js = await connect(settings, name="test-runner-election")
    try:
        await ensure_streams(js, names, settings)
    finally:
        await nc.close()
    killed = await nats_cluster.kill_leader_of(names.runs_stream, names.consumer)
    store = await SqliteRunStore.open(tmp_path / "runs.db")
    runner = Runner(
        store=store,
        driver=LocalSandboxDriver(tmp_path / "data"),
        data_dir=tmp_path / "data",
        settings=RunnerSettings(http_host="127.0.0.1", sweeper=False, backstop=False),
        wire=settings,
    )
    try:
        await runner.start()  # raised a NATS timeout (exit 4) before the wait
        assert runner.svc is not None
    finally:
        await runner.shutdown()
        await store.close()
        nats_cluster.restart(killed)
