"""The kubernetes sandbox's exec transport end to end (SPEC v2.2 §7.1; issue 13, "exec and tar
over exec").

The client side is the real `kubernetes.aio` client code (URL, auth, session) and our channel
protocol over a real websocket; the server side is `tests/support/exec_server.py`, which runs each
command as a real local subprocess. Nothing is mocked; every wait is on the condition itself.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
from kubernetes.aio.client import ApiClient, Configuration, CoreV1Api, V1Pod

from engine.sandbox.errors import (
    SandboxArchiveInvalid,
    SandboxCopyFailed,
    SandboxExecFailed,
    SandboxLost,
)
from engine.sandbox.kubernetes.copy import copy_in, copy_out
from engine.sandbox.kubernetes.exec import (
    TIMED_OUT_EXIT_CODE,
    exec_in_pod,
    exit_code_from_status,
)
from engine.sandbox.protocols import OUTPUT_CHUNK_BYTES, OUTPUT_TAIL_BYTES
from tests.engine.kubernetes.cluster import silent_api_server
from tests.support.exec_server import PROTOCOL_V4, ExecServer

NS, POD, CONTAINER = "runfleet", "rf-run1-tok1", "sandbox"
DEADLINE_S = 10.0


async def _api(url: str) -> CoreV1Api:
    configuration = Configuration(host=url)
    return CoreV1Api(ApiClient(configuration))


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ExecServer]:
    async with ExecServer(tmp_path / "pods") as srv:
        yield srv


@pytest.fixture
async def api(server: ExecServer) -> AsyncIterator[CoreV1Api]:
    core = await _api(server.url)
    yield core
    await core.api_client.close()


async def _poll(condition: object, what: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S}s: {what}")
        await asyncio.sleep(0.01)


class Collected:
    def __init__(self) -> None:
        self.chunks: list[tuple[str, bytes]] = []

    async def __call__(self, stream: str, chunk: bytes) -> None:
        self.chunks.append((stream, chunk))

    def joined(self, stream: str) -> bytes:
        return b"".join(c for s, c in self.chunks if s == stream)


async def test_exec_streams_stdout_and_stderr_each_in_order_as_they_arrive(
    server: ExecServer, api: CoreV1Api
) -> None:
    go = server.pod_root(NS, POD) / "go"
    seen = Collected()

    async def on_output(stream: str, chunk: bytes) -> None:
        await seen(stream, chunk)
        if b"ready" in seen.joined("stdout"):
            go.touch()  # the command waits for this: only output streamed before its end opens it

    script = (
        "for i in 1 2 3; do echo out$i; echo err$i >&2; done; echo ready; "
        "while [ ! -e go ]; do sleep 0.01; done; echo after"
    )
    result = await exec_in_pod(
        api, NS, POD, CONTAINER, ["sh", "-c", script], timeout=DEADLINE_S, on_output=on_output
    )
    assert not result.timed_out
    assert result.exit_code == 0
    assert seen.joined("stdout") == b"out1\nout2\nout3\nready\nafter\n"
    assert seen.joined("stderr") == b"err1\nerr2\nerr3\n"
    assert (result.stdout_tail, result.stderr_tail) == (
        seen.joined("stdout"),
        seen.joined("stderr"),
    )


@pytest.mark.parametrize("code", [0, 1, 75])
async def test_exec_returns_the_exit_code_the_error_channel_status_carries(
    api: CoreV1Api, code: int
) -> None:
    result = await exec_in_pod(
        api, NS, POD, CONTAINER, ["sh", "-c", f"echo bye; exit {code}"], timeout=DEADLINE_S
    )
    assert (result.exit_code, result.timed_out, result.stdout_tail) == (code, False, b"bye\n")


def test_exit_code_from_status_reads_success_and_non_zero_exit_and_refuses_anything_else() -> None:
    assert exit_code_from_status(b'{"metadata":{},"status":"Success"}', "p") == 0
    failure = (
        b'{"status":"Failure","reason":"NonZeroExitCode",'
        b'"details":{"causes":[{"reason":"ExitCode","message":"42"}]}}'
    )
    assert exit_code_from_status(failure, "p") == 42
    for status in (
        b'{"status":"Failure","reason":"InternalError","message":"container not found"}',
        b'{"status":"Failure","reason":"NonZeroExitCode","details":{"causes":[]}}',
        b"not json",
        b"[1]",
    ):
        with pytest.raises(SandboxExecFailed):
            exit_code_from_status(status, "p")


async def test_exec_past_its_timeout_is_abandoned_and_reported_timed_out_like_the_local_driver(
    server: ExecServer, api: CoreV1Api
) -> None:
    started = time.monotonic()
    result = await exec_in_pod(
        api, NS, POD, CONTAINER, ["sh", "-c", "echo started; exec sleep 60"], timeout=0.5
    )
    assert result.timed_out
    assert result.exit_code == TIMED_OUT_EXIT_CODE == -15
    assert 0.5 <= result.duration_s < 5.0
    assert time.monotonic() - started < 5.0
    # abandoned: the stream is gone, so the test server ends the command
    await _poll(lambda: server.live_execs(NS, POD) == 0, "the abandoned command ended")


async def test_exec_writes_stdin_and_closes_it_so_the_command_sees_its_end(
    api: CoreV1Api,
) -> None:
    data = os.urandom(1024 * 1024 + 17)
    seen = Collected()
    result = await exec_in_pod(
        api, NS, POD, CONTAINER, ["cat"], timeout=DEADLINE_S, on_output=seen, stdin=data
    )
    assert (result.exit_code, result.timed_out) == (0, False)
    assert seen.joined("stdout") == data
    empty = await exec_in_pod(api, NS, POD, CONTAINER, ["cat"], timeout=DEADLINE_S)
    assert (empty.exit_code, empty.stdout_tail) == (0, b"")  # no stdin: an empty one, not a hang


async def test_exec_streams_a_large_output_whole_in_bounded_chunks_and_keeps_its_tail(
    api: CoreV1Api,
) -> None:
    expected = b"".join(b"%d\n" % i for i in range(1, 1_000_001))
    seen = Collected()
    result = await exec_in_pod(
        api, NS, POD, CONTAINER, ["seq", "1", "1000000"], timeout=60.0, on_output=seen
    )
    assert result.exit_code == 0
    assert seen.joined("stdout") == expected
    assert max(len(c) for _, c in seen.chunks) <= OUTPUT_CHUNK_BYTES
    assert result.stdout_tail == expected[-OUTPUT_TAIL_BYTES:]


async def test_a_cancelled_exec_is_abandoned_at_once_as_the_continuity_watch_needs(
    server: ExecServer, api: CoreV1Api
) -> None:
    """§7.2: the watch abandons the exec in flight by cancelling it; that takes no time."""
    running = asyncio.create_task(
        exec_in_pod(api, NS, POD, CONTAINER, ["sleep", "60"], timeout=DEADLINE_S)
    )
    await _poll(lambda: server.live_execs(NS, POD) == 1, "the command runs")
    cancelled_at = time.monotonic()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert time.monotonic() - cancelled_at < 2.0
    await _poll(lambda: server.live_execs(NS, POD) == 0, "the abandoned command ended")


async def test_an_exception_from_on_output_abandons_the_exec_and_propagates(
    server: ExecServer, api: CoreV1Api
) -> None:
    async def on_output(stream: str, chunk: bytes) -> None:
        raise OSError("the log sink is full")

    with pytest.raises(OSError, match="the log sink is full"):
        await exec_in_pod(
            api, NS, POD, CONTAINER, ["sh", "-c", "echo x; exec sleep 60"], timeout=DEADLINE_S,
            on_output=on_output,
        )  # fmt: skip
    await _poll(lambda: server.live_execs(NS, POD) == 0, "the abandoned command ended")


async def test_a_broken_exec_connection_is_sandbox_exec_failed_not_a_result(
    server: ExecServer, api: CoreV1Api
) -> None:
    async def on_output(stream: str, chunk: bytes) -> None:
        assert server.break_connections(NS, POD) == 1

    with pytest.raises(SandboxExecFailed, match=r"broke|closed before"):
        await exec_in_pod(
            api, NS, POD, CONTAINER, ["sh", "-c", "echo up; exec sleep 60"], timeout=DEADLINE_S,
            on_output=on_output,
        )  # fmt: skip
    await _poll(lambda: server.live_execs(NS, POD) == 0, "the cut-off command ended")


async def test_an_unreachable_api_server_is_sandbox_exec_failed(tmp_path: Path) -> None:
    async with ExecServer(tmp_path) as gone:
        url = gone.url  # a port nobody listens on once it is closed
    core = await _api(url)
    try:
        with pytest.raises(SandboxExecFailed, match="broke"):
            await exec_in_pod(core, NS, POD, CONTAINER, ["true"], timeout=DEADLINE_S)
    finally:
        await core.api_client.close()


async def test_an_exec_in_a_deleted_pod_is_sandbox_lost_and_one_in_flight_ends_with_137(
    server: ExecServer, api: CoreV1Api
) -> None:
    async def on_output(stream: str, chunk: bytes) -> None:
        server.delete_pod(NS, POD)

    cut = await exec_in_pod(
        api, NS, POD, CONTAINER, ["sh", "-c", "echo up; exec sleep 60"], timeout=DEADLINE_S,
        on_output=on_output,
    )  # fmt: skip
    assert (cut.exit_code, cut.timed_out) == (137, False)  # the kubelet's word for a killed pod
    with pytest.raises(SandboxLost, match="404"):
        await exec_in_pod(api, NS, POD, CONTAINER, ["true"], timeout=DEADLINE_S)


async def test_an_api_server_without_v5_cannot_take_stdin_and_says_so_before_running_it(
    tmp_path: Path,
) -> None:
    async with ExecServer(tmp_path, protocols=(PROTOCOL_V4,)) as old:
        core = await _api(old.url)
        try:
            plain = await exec_in_pod(core, NS, POD, CONTAINER, ["sh", "-c", "exit 3"], timeout=5)
            assert plain.exit_code == 3  # v4 serves everything but a stdin's end
            with pytest.raises(SandboxExecFailed, match=r"v5\.channel\.k8s\.io"):
                await exec_in_pod(core, NS, POD, CONTAINER, ["cat"], timeout=5, stdin=b"x")
        finally:
            await core.api_client.close()


def _tree(root: Path) -> dict[str, bytes | None]:
    """Relative path → content (None for a directory), every entry under `root`."""
    return {
        p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _make_tree(root: Path) -> None:
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "top.txt").write_bytes(b"top\n")
    (root / "a" / "blob.bin").write_bytes(os.urandom(300_000))
    (root / "a" / "b" / "c" / "deep.txt").write_bytes("ünïcode\n".encode())
    (root / "a" / "b" / "empty").write_bytes(b"")
    (root / ".hidden").write_bytes(b"dot\n")


def _tar_of(src: Path, dest: Path) -> None:
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name)


async def test_copy_in_then_copy_out_round_trips_a_nested_directory_byte_for_byte(
    server: ExecServer, api: CoreV1Api, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    _make_tree(src)
    archive = tmp_path / "in.tar"
    _tar_of(src, archive)
    await copy_in(api, NS, POD, CONTAINER, archive, "/workspace/data/seed")
    assert _tree(server.pod_root(NS, POD) / "workspace" / "data" / "seed") == _tree(src)

    out = tmp_path / "out.tgz"
    await copy_out(api, NS, POD, CONTAINER, "/workspace/data/seed", out, gzip_level=6)
    back = tmp_path / "back"
    with tarfile.open(out, "r:gz") as tar:
        tar.extractall(back, filter="data")
    assert _tree(back) == _tree(src)

    plain = tmp_path / "out.tar"
    await copy_out(api, NS, POD, CONTAINER, "/workspace/data/seed", plain, gzip_level=None)
    with tarfile.open(plain, "r:") as tar:  # not compressed at all
        names = {m.name.removeprefix("./") for m in tar if m.name not in (".", "./")}
    assert names == set(_tree(src))


async def test_copy_in_takes_a_gzipped_archive_too(
    server: ExecServer, api: CoreV1Api, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    _make_tree(src)
    archive = tmp_path / "in.tgz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(src, arcname=".")
    await copy_in(api, NS, POD, CONTAINER, archive, "/scratch")
    assert _tree(server.pod_root(NS, POD) / "scratch") == _tree(src)


@pytest.mark.parametrize(("level", "xfl"), [(1, 4), (6, 0), (9, 2)])
async def test_copy_out_gzips_on_the_host_at_the_explicit_level(
    server: ExecServer, api: CoreV1Api, tmp_path: Path, level: int, xfl: int
) -> None:
    (server.pod_root(NS, POD) / "scratch" / "f").write_bytes(b"x" * 100_000)
    out = tmp_path / "out.tgz"
    await copy_out(api, NS, POD, CONTAINER, "/scratch", out, gzip_level=level)
    header = out.read_bytes()[:10]
    assert header[:2] == b"\x1f\x8b"
    assert header[8] == xfl  # zlib's XFL byte: 4 fastest (level 1), 2 best (9), 0 otherwise
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(out.read_bytes()))) as tar:
        member = tar.extractfile("./f")
        assert member is not None and member.read() == b"x" * 100_000


async def test_copy_out_of_a_missing_directory_is_sandbox_copy_failed_and_leaves_no_file(
    api: CoreV1Api, tmp_path: Path
) -> None:
    out = tmp_path / "out.tgz"
    with pytest.raises(SandboxCopyFailed, match="could not archive"):
        await copy_out(api, NS, POD, CONTAINER, "/workspace/nope", out)
    assert not out.exists()


async def test_copy_in_refuses_an_escaping_archive_before_anything_is_sent(
    server: ExecServer, api: CoreV1Api, tmp_path: Path
) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    with pytest.raises(SandboxArchiveInvalid, match="refused"):
        await copy_in(api, NS, POD, CONTAINER, archive, "/workspace")
    (tmp_path / "junk.tar").write_bytes(b"this is not a tar archive at all" * 40)
    with pytest.raises(SandboxArchiveInvalid):
        await copy_in(api, NS, POD, CONTAINER, tmp_path / "junk.tar", "/workspace")
    assert server.execs == []


async def test_a_copy_in_not_done_within_its_budget_is_sandbox_copy_failed_not_a_hang(
    tmp_path: Path,
) -> None:
    """A restore's `tar -x` that stalls (here an API server that never answers the exec) ends
    at the copy's budget with the typed copy error, instead of holding the execution forever
    while its lease renews."""
    src = tmp_path / "src"
    _make_tree(src)
    archive = tmp_path / "in.tar"
    _tar_of(src, archive)
    async with silent_api_server() as url:
        core = await _api(url)
        try:
            with pytest.raises(SandboxCopyFailed, match=r"within its 0\.2s budget"):
                await copy_in(
                    api=core,
                    namespace=NS,
                    pod=POD,
                    container=CONTAINER,
                    tar_path=archive,
                    dest_dir="/scratch",
                    timeout_s=0.2,
                )
        finally:
            await core.api_client.close()


async def test_the_exec_server_fronts_kmock_so_pods_and_execs_share_one_host(
    tmp_path: Path,
) -> None:
    async with (
        kmock.KubernetesEmulator() as emulator,
        ExecServer(tmp_path, fallback=emulator) as srv,
    ):
        core = await _api(srv.url)
        try:
            body = V1Pod.model_validate({"metadata": {"name": POD, "namespace": NS}})
            await core.create_namespaced_pod(NS, body)
            pod = await core.read_namespaced_pod(POD, NS)
            assert pod.metadata is not None and pod.metadata.name == POD
            result = await exec_in_pod(core, NS, POD, CONTAINER, ["echo", "hi"], timeout=5)
            assert (result.exit_code, result.stdout_tail) == (0, b"hi\n")
        finally:
            await core.api_client.close()
