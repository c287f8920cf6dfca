"""A copy out's bound on the kubernetes driver (docs/reliability.md, "A second review": the bank's
host temp): the pod's `tar -c` arrives over the exec websocket, and the copy counts it as it
arrives, cuts the stream the moment the count passes `max_bytes` (the pod's tar is ended, not
read to its end) and removes the partial host file. The pod side is the local exec server
(`tests.support.exec_server`), which runs the real `tar` over the real wire; the scratch's huge
file is sparse, so the pod's tar streams every byte of it while no disk holds them."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes.aio.client import ApiClient, Configuration, CoreV1Api

from engine.sandbox.errors import SandboxCopyTooLarge
from engine.sandbox.kubernetes.copy import copy_out
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.protocols import OUTPUT_CHUNK_BYTES, SandboxSpec, SetupBudgets
from engine.scratch import ScratchBank
from store.blobs_fs import FilesystemBlobStore
from tests.engine.bank_doubles import Records, Said
from tests.engine.conftest import poll_until
from tests.engine.kubernetes.cluster import NAMESPACE, Cluster, fake_cluster
from tests.support.exec_server import ExecServer

NS, POD, CONTAINER = "runfleet", "rf-run1-tok1", "sandbox"
HUGE = 256 * 1024 * 1024
"""The sparse file's size: what the pod's tar would stream, unbounded (seconds of websocket)."""
BOUND = 1024 * 1024


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ExecServer]:
    async with ExecServer(tmp_path / "pods") as srv:
        yield srv


@pytest.fixture
async def api(server: ExecServer) -> AsyncIterator[CoreV1Api]:
    core = CoreV1Api(ApiClient(Configuration(host=server.url)))
    yield core
    await core.api_client.close()


def _sparse(path: Path, size: int = HUGE) -> None:
    with path.open("wb") as f:
        f.truncate(size)


@contextlib.contextmanager
def _largest_size(directory: Path) -> Iterator[list[int]]:
    """Samples the bytes held under `directory` while the block runs, for a test to assert an
    upper bound on (an observation, never a wait: a sample missed only makes it weaker)."""
    seen = [0]

    def held() -> int:
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())

    async def sample() -> None:
        while True:
            seen[0] = max(seen[0], held())
            await asyncio.sleep(0.002)

    task = asyncio.get_running_loop().create_task(sample())
    try:
        yield seen
    finally:
        task.cancel()


async def test_copy_out_past_its_bound_stops_streaming_and_leaves_no_partial_file(
    server: ExecServer, api: CoreV1Api, tmp_path: Path
) -> None:
    scratch = server.pod_root(NS, POD) / "scratch"
    (scratch / "small.txt").write_text("kept\n")
    _sparse(scratch / "huge.bin")
    host = tmp_path / "host"
    host.mkdir()
    dest = host / "scratch.tar"
    with _largest_size(host) as largest, pytest.raises(SandboxCopyTooLarge) as caught:
        await copy_out(api, NS, POD, CONTAINER, "/scratch", dest, gzip_level=None, max_bytes=BOUND)
    exc = caught.value
    assert exc.code == "sandbox_copy_too_large" and exc.max_bytes == BOUND
    # counted as it arrived: cut at the chunk that passed the bound, that chunk never written
    assert BOUND < exc.received <= BOUND + OUTPUT_CHUNK_BYTES
    assert largest[0] <= BOUND
    assert not dest.exists() and list(host.iterdir()) == []

    async def live() -> int:
        return server.live_execs(NS, POD)

    # the stream was cut, not drained: the pod's tar is ended, not read to its 256 MiB
    await poll_until(live, lambda n: n == 0, within=5, what="the pod's tar ended")


async def test_copy_out_bound_counts_the_tar_not_its_host_gzip(
    server: ExecServer, api: CoreV1Api, tmp_path: Path
) -> None:
    """Zeros gzip to almost nothing, yet the bound is on the stream the pod sends: a host gzip
    does not let a huge tar through."""
    _sparse(server.pod_root(NS, POD) / "scratch" / "zeros.bin", 8 * BOUND)
    dest = tmp_path / "scratch.tgz"
    with pytest.raises(SandboxCopyTooLarge):
        await copy_out(api, NS, POD, CONTAINER, "/scratch", dest, gzip_level=1, max_bytes=BOUND)
    assert not dest.exists()
    await copy_out(api, NS, POD, CONTAINER, "/scratch", dest, gzip_level=1, max_bytes=16 * BOUND)
    assert 0 < dest.stat().st_size < BOUND  # under the bound: copied whole, gzipped


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with fake_cluster(tmp_path / "pods") as c:
        yield c


@pytest.fixture
async def driver(cluster: Cluster) -> AsyncIterator[KubernetesSandboxDriver]:
    settings = KubernetesSettings(
        namespace=NAMESPACE,
        image="busybox:1.36",
        budgets=SetupBudgets(schedule_s=0.6, ready_s=0.6, seed_s=5),
        delete_grace_s=0,
        gone_timeout_s=5,
    )
    d = KubernetesSandboxDriver(settings, api_factory=cluster.api_factory, poll_s=0.02)
    yield d
    await d.close()


async def test_a_pod_scratch_past_the_bound_is_unbankable_as_over_the_cap_and_never_fills_the_host(
    driver: KubernetesSandboxDriver,
    cluster: Cluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bank's host temp (where `copy_out` lands) never holds much more than the bound, the
    pod's tar is ended, and the scratch is recorded `unbankable`, "over the cap", nothing
    uploaded: the outcome of a scratch over the compressed cap (SPEC §7.3)."""
    spec = SandboxSpec(
        run_id="run-1", lease_token="tok1", workspace_dir=tmp_path / "ws", scratch_dir=tmp_path
    )
    sandbox = await driver.start(spec)
    host_temp = tmp_path / "host-temp"
    host_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(host_temp))
    try:
        made = await sandbox.exec(
            'echo kept > "$RUNFLEET_SCRATCH_DIR/kept" && '
            f'truncate -s {HUGE} "$RUNFLEET_SCRATCH_DIR/huge.bin"',
            timeout_s=10,
        )
        assert made.exit_code == 0, made
        blobs = FilesystemBlobStore(tmp_path / "blobs")
        records, said = Records(), Said()
        bank = ScratchBank(
            run_id="run-1",
            token="tok1",
            blobs=blobs,
            writer=records,  # type: ignore[arg-type]
            events=said,  # type: ignore[arg-type]
            cap_bytes=BOUND,
            budget_s=30,
            host_scratch=tmp_path / "no-host-scratch",
            max_uncompressed_bytes=BOUND,
        )
        with _largest_size(host_temp) as largest:
            banked = await bank.bank(sandbox, host_dir=False, process_isolated=True, progress=1)
        assert banked.state == "unbankable", banked
        assert banked.reason.startswith("over the cap: ")
        assert "passed its bound of 1048576 bytes uncompressed" in banked.reason
        assert largest[0] <= BOUND
        assert list(host_temp.iterdir()) == []
        [record] = records.records
        assert record["state"] == "unbankable" and record["key"] is None
        [(kind, data)] = said.said
        assert kind == "sandbox_scratch_banked" and not data["banked"] and not data["unknown"]
        assert await blobs.list("runs/") == []

        async def live() -> int:
            return cluster.exec_server.live_execs(NAMESPACE, sandbox.name)

        await poll_until(live, lambda n: n == 0, within=5, what="the pod's tar ended")
    finally:
        await sandbox.stop()
