"""The kubernetes driver's API calls against a local fake API server (kmock on 127.0.0.1, the
exec subresource served by the local exec server): create, get, list, delete, 404, 409, a pod
that never schedules, one that crash-loops, and the watch wired so a lost pod fails the exec in
flight at once (SPEC §7.1, §7.2)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes.aio.client import ApiClient, ApiException, Configuration, CoreV1Api, V1Pod

from engine.archive import make_archive
from engine.failures import FailureCode
from engine.sandbox import (
    SandboxCapacity,
    SandboxDriver,
    SandboxError,
    SandboxImageInvalid,
    SandboxLost,
    SandboxSetupTimeout,
    SandboxSpec,
    SandboxStartFailed,
)
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.pod import LABEL_MANAGED_BY, LABEL_RUN_ID, build_pod
from engine.sandbox.kubernetes.sandbox import KubernetesSandbox
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.protocols import SeedDir, SetupBudgets
from engine.scratch import ScratchBank, bank_key
from store import ScratchRecord
from store.blobs_fs import FilesystemBlobStore
from tests.engine.bank_doubles import Records, Said
from tests.engine.conftest import poll_until
from tests.engine.kubernetes.cluster import (
    NAMESPACE,
    Cluster,
    fake_cluster,
    never_ready,
    silent_api_server,
    unschedulable,
    waiting,
)

pytestmark = pytest.mark.asyncio
FAST = SetupBudgets(schedule_s=0.6, ready_s=0.6, seed_s=5)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with fake_cluster(tmp_path / "pods") as c:
        yield c


@pytest.fixture
async def driver(cluster: Cluster) -> AsyncIterator[KubernetesSandboxDriver]:
    settings = KubernetesSettings(
        namespace=NAMESPACE, image="busybox:1.36", budgets=FAST, delete_grace_s=0, gone_timeout_s=5
    )
    d = KubernetesSandboxDriver(settings, api_factory=cluster.api_factory, poll_s=0.02)
    yield d
    await d.close()


def spec(tmp_path: Path, run_id: str = "run-1", token: str = "tok1", **kw: Any) -> SandboxSpec:
    return SandboxSpec(
        run_id=run_id,
        lease_token=token,
        workspace_dir=tmp_path / "ws",
        scratch_dir=tmp_path / "scratch",
        **kw,
    )


async def _watching(sandbox: KubernetesSandbox) -> None:
    """Until the sandbox's watch is streaming. kmock ignores a watch's resourceVersion (a real
    API server replays what happened since the list): an event between the watch's list and
    its stream would be missed here, never on a cluster."""

    async def events() -> int:
        return sandbox.watch._events  # the pod's ADDED event: the stream is up

    await poll_until(events, bool, what="the watch streaming")


async def test_driver_capabilities_are_process_isolated_not_host_backed_with_dir_copy(
    driver: KubernetesSandboxDriver,
) -> None:
    assert isinstance(driver, SandboxDriver)
    caps = driver.capabilities
    assert (caps.process_isolated, caps.host_backed_scratch, caps.supports_dir_copy) == (
        True,
        False,
        True,
    )


async def test_start_creates_one_labelled_pod_per_execution_and_execs_in_it(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    sandbox = await driver.start(spec(tmp_path))
    pods = cluster.pods()
    assert list(pods) == [sandbox.name]
    labels = pods[sandbox.name]["metadata"]["labels"]
    assert labels[LABEL_RUN_ID] == "run-1" and labels[LABEL_MANAGED_BY] == "runfleet"
    chunks: list[tuple[str, bytes]] = []

    async def on_output(stream: str, chunk: bytes) -> None:
        chunks.append((stream, chunk))

    result = await sandbox.exec(
        "echo out; echo err >&2; pwd; exit 3", timeout_s=10, on_output=on_output
    )
    assert result.exit_code == 3 and not result.timed_out
    assert b"out\n" in result.stdout_tail and result.stderr_tail == b"err\n"
    assert result.stdout_tail.strip().endswith(b"/workspace")  # cwd = the workspace
    assert ("stderr", b"err\n") in chunks
    timed = await sandbox.exec("sleep 30", timeout_s=0.5)
    assert timed.timed_out
    await sandbox.stop()
    assert cluster.pods() == {}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


async def test_a_timed_out_command_is_ended_inside_the_pod_with_all_it_started(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    """SPEC §7.2: a node's timeout stops what it started. Closing the exec's stream does not
    (the fake cluster's exec server keeps orphans, as a kubelet does): the sandbox ends the
    command's shell and its children with a second exec."""
    sandbox = await driver.start(spec(tmp_path))
    timed = await sandbox.exec("sleep 60 & echo $! > /workspace/child.pid; wait", timeout_s=0.5)
    assert timed.timed_out
    child = cluster.exec_server.pod_root(NAMESPACE, sandbox.name) / "workspace" / "child.pid"
    pid = int(child.read_text())

    async def running() -> bool:
        return _alive(pid)

    await poll_until(running, lambda alive: not alive, what="the timed-out command's child ended")
    ok = await sandbox.exec("echo next", timeout_s=10)  # the pod is still usable
    assert (ok.exit_code, ok.stdout_tail) == (0, b"next\n")
    await sandbox.stop()


async def test_copy_in_and_out_as_tar_over_exec(
    driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    sandbox = await driver.start(spec(tmp_path))
    tar_in = tmp_path / "in.tar"
    with tarfile.open(tar_in, "w") as tar:
        data = b"hello"
        info = tarfile.TarInfo("dir/a.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    await sandbox.copy_in(tar_in, Path("seeded"))
    assert (await sandbox.exec("cat seeded/dir/a.txt", timeout_s=10)).stdout_tail == b"hello"
    out = tmp_path / "out.tar"
    await sandbox.copy_out(Path("seeded"), out)
    with tarfile.open(out) as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        assert "dir/a.txt" in names, names
        member = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("dir/a.txt")))
        assert member is not None and member.read() == b"hello"
    await sandbox.stop()


async def test_seed_dirs_are_copied_in_during_the_seed_phase(
    driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    seed = tmp_path / "bank"
    seed.mkdir()
    (seed / "note").write_text("kept")
    sandbox = await driver.start(spec(tmp_path, seed_dirs=(SeedDir(seed, "/scratch"),)))
    assert (
        await sandbox.exec('cat "$RUNFLEET_SCRATCH_DIR/note"', timeout_s=10)
    ).stdout_tail == b"kept"
    await sandbox.stop()


async def test_a_seed_phase_that_stalls_past_its_budget_is_sandbox_setup_timeout(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    seed = tmp_path / "bank"
    seed.mkdir()
    (seed / "big").write_bytes(b"x" * 1024)
    budgets = SetupBudgets(schedule_s=5, ready_s=5, seed_s=0.000001)
    with pytest.raises(SandboxSetupTimeout, match=r"seed phase.*budget"):
        await driver.start(spec(tmp_path, seed_dirs=(SeedDir(seed, "/scratch"),), budgets=budgets))
    assert cluster.pods() == {}  # nothing left running after a failure


async def test_list_sandboxes_and_stop_others_filter_by_label_client_side(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    old = await driver.start(spec(tmp_path, token="old"))
    new = await driver.start(spec(tmp_path, token="new"))
    other = await driver.start(spec(tmp_path, run_id="run-2", token="x"))
    async with cluster.api_client() as api_client:  # a pod that is not runfleet's
        stranger = build_pod(run_id="run-1", token="s", namespace=NAMESPACE, image="i")
        assert stranger.metadata is not None and stranger.metadata.labels is not None
        stranger.metadata.labels.pop(LABEL_MANAGED_BY)
        stranger.metadata.name = "stranger"
        await CoreV1Api(api_client).create_namespaced_pod(NAMESPACE, stranger)
    refs = {(r.run_id, r.token, r.name) for r in await driver.list_sandboxes()}
    assert refs == {
        ("run-1", "old", old.name),
        ("run-1", "new", new.name),
        ("run-2", "x", other.name),
    }
    assert await driver.stop_others("run-1", keep_token="new") == [old.name]
    assert set(cluster.pods()) == {new.name, other.name, "stranger"}
    assert await driver.stop_others("run-1", keep_token="new") == []
    for sandbox in (old, new, other):
        await sandbox.stop()  # idempotent, and a 404 on the old one's delete is no error


async def test_stop_deletes_with_the_grace_and_confirms_gone(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    sandbox = await driver.start(spec(tmp_path))
    await sandbox.stop()
    async with cluster.api_client() as api_client:
        with pytest.raises(ApiException) as raised:
            await CoreV1Api(api_client).read_namespaced_pod(sandbox.name, NAMESPACE)
    assert raised.value.status == 404
    with pytest.raises(SandboxLost):
        await sandbox.exec("true", timeout_s=5)


async def test_a_pod_name_taken_by_another_is_a_409_and_start_failed(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    async with cluster.api_client() as api_client:
        squatter = build_pod(run_id="run-1", token="tok1", namespace=NAMESPACE, image="i")
        await CoreV1Api(api_client).create_namespaced_pod(NAMESPACE, squatter)
    with pytest.raises(SandboxStartFailed, match="409"):
        await driver.start(spec(tmp_path))


async def test_a_pod_that_never_schedules_is_sandbox_capacity_past_the_schedule_budget(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    cluster.kubelet.script = unschedulable
    began = time.monotonic()
    with pytest.raises(SandboxCapacity, match=r"schedule phase: not scheduled.*Insufficient cpu"):
        await driver.start(spec(tmp_path))
    assert time.monotonic() - began >= FAST.schedule_s
    assert cluster.pods() == {}


async def test_a_pod_that_crash_loops_is_sandbox_start_failed(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    cluster.kubelet.script = waiting("CrashLoopBackOff", phase="Running")
    with pytest.raises(SandboxStartFailed, match="CrashLoopBackOff"):
        await driver.start(spec(tmp_path))
    assert cluster.pods() == {}


async def test_an_image_pull_error_while_pending_is_sandbox_image_invalid_at_once(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    cluster.kubelet.script = waiting("ErrImagePull")
    began = time.monotonic()
    with pytest.raises(SandboxImageInvalid, match="ErrImagePull"):
        await driver.start(spec(tmp_path, image="nope:404"))
    assert time.monotonic() - began < FAST.schedule_s  # not held to the schedule budget
    assert cluster.pods() == {}


async def test_running_but_never_ready_is_sandbox_start_failed_past_the_ready_budget(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    cluster.kubelet.script = never_ready
    with pytest.raises(SandboxStartFailed, match=r"ready phase: Running but never Ready"):
        await driver.start(spec(tmp_path))


async def test_a_lost_pod_abandons_the_exec_in_flight_within_2s(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    sandbox = await driver.start(spec(tmp_path))
    started = asyncio.Event()

    async def on_output(stream: str, chunk: bytes) -> None:
        started.set()

    running = asyncio.create_task(
        sandbox.exec("echo go; sleep 60", timeout_s=120, on_output=on_output)
    )
    await asyncio.wait_for(started.wait(), 10)
    await _watching(sandbox)
    # the API object goes (kmock keeps the node's processes: only the watch can say so)
    async with cluster.api_client() as api_client:
        await CoreV1Api(api_client).delete_namespaced_pod(sandbox.name, NAMESPACE)
    began = time.monotonic()
    with pytest.raises(SandboxLost, match="deleted") as raised:
        result = await running
        pytest.fail(f"the exec ended instead: {result}")  # pragma: no cover
    assert time.monotonic() - began < 2.0
    assert raised.value.reason == "deleted"  # sandbox_lost {reason, message}

    # abandoned: the exec's connection is closed, so its command is no longer attached
    async def live() -> int:
        return cluster.exec_server.live_execs(NAMESPACE, sandbox.name)

    await poll_until(live, lambda n: n == 0, within=5, what="the exec abandoned")
    await sandbox.stop()


async def test_a_pod_deleted_with_its_processes_killed_is_sandbox_lost_not_a_tool_failure(
    cluster: Cluster, driver: KubernetesSandboxDriver, tmp_path: Path
) -> None:
    """The kubelet kills a deleted pod's commands: the exec's exit 137 may come before the
    watch's DELETED event; the node still fails SANDBOX_LOST."""
    sandbox = await driver.start(spec(tmp_path))
    started = asyncio.Event()

    async def on_output(stream: str, chunk: bytes) -> None:
        started.set()

    running = asyncio.create_task(
        sandbox.exec("echo go; sleep 60", timeout_s=120, on_output=on_output)
    )
    await asyncio.wait_for(started.wait(), 10)
    await _watching(sandbox)
    cluster.exec_server.delete_pod(NAMESPACE, sandbox.name)  # the node kills it first
    await cluster.delete(sandbox.name)
    with pytest.raises(SandboxLost):
        await running
    await sandbox.stop()


def _bank(blobs: FilesystemBlobStore, tmp_path: Path, run_id: str = "run-1") -> ScratchBank:
    return ScratchBank(
        run_id=run_id,
        token="tok1",
        blobs=blobs,
        writer=Records(),  # type: ignore[arg-type]
        events=Said(),  # type: ignore[arg-type]
        cap_bytes=1 << 20,
        budget_s=30,
        host_scratch=tmp_path / "no-host-scratch",
    )


async def test_a_fifo_in_a_pod_scratch_is_skipped_by_the_bank_as_on_a_host_scratch(
    driver: KubernetesSandboxDriver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fifo (or device) left in the scratch does not make the run unbankable: the pod's tar
    carries it, the host skips it as `make_archive` skips one on a host-backed scratch, and a
    log line names it."""
    sandbox = await driver.start(spec(tmp_path))
    try:
        made = await sandbox.exec(
            'mkfifo "$RUNFLEET_SCRATCH_DIR/pipe" && echo kept > "$RUNFLEET_SCRATCH_DIR/kept"',
            timeout_s=10,
        )
        assert made.exit_code == 0, made
        blobs = FilesystemBlobStore(tmp_path / "blobs")
        with caplog.at_level(logging.INFO, logger="engine.scratch"):
            banked = await _bank(blobs, tmp_path).bank(
                sandbox, host_dir=False, process_isolated=True, progress=1
            )
        assert banked.state == "banked", banked
        fetched = tmp_path / "fetched.tgz"
        await blobs.get_to_file(bank_key("run-1", "tok1"), fetched)
        with tarfile.open(fetched) as tar:
            names = set(tar.getnames())
        assert "kept" in names and "pipe" not in names, names
        assert "special file" in caplog.text and "pipe" in caplog.text
    finally:
        await sandbox.stop()


class _UnreachableAfterDelete:
    """An API whose delete is answered, then every read of the pod finds no API server."""

    def __init__(self) -> None:
        self.deleted = 0
        self.reads: list[dict[str, Any]] = []

    async def delete_namespaced_pod(self, name: str, ns: str, **kw: Any) -> None:
        self.deleted += 1

    async def read_namespaced_pod(self, name: str, ns: str, **kw: Any) -> V1Pod:
        self.reads.append(kw)
        raise aiohttp.ClientConnectionError("connection reset by the API server")


class _IdleWatch:
    """A continuity watch that sees nothing until it is stopped."""

    def __init__(self) -> None:
        self._stopped = asyncio.Event()
        self.lost = asyncio.Event()
        self.reason: str | None = None
        self.message: str | None = None

    async def run(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


def _unreachable_driver(**budgets: float) -> KubernetesSandboxDriver:
    settings = KubernetesSettings(
        namespace=NAMESPACE,
        image="busybox:1.36",
        budgets=SetupBudgets(**{"schedule_s": 5, "ready_s": 5, "seed_s": 5, **budgets}),
        gone_timeout_s=0.2,
    )
    return KubernetesSandboxDriver(settings, poll_s=0.01)


async def test_an_api_server_unreachable_while_a_stop_confirms_the_delete_is_a_typed_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The delete's confirm loop asks with a request timeout and translates an unreachable
    API server like the rest of the driver (`SandboxError`); `stop()` logs it and returns, so
    the execution's workspace and attachments cleanup after it still runs."""
    driver = _unreachable_driver()
    api = _UnreachableAfterDelete()
    with pytest.raises(SandboxError, match=r"not confirmed gone.*not answered"):
        await driver.delete_pod(api, "rf-x", "uid-1")  # type: ignore[arg-type]
    assert api.reads and all(kw.get("_request_timeout") for kw in api.reads)
    sandbox = KubernetesSandbox(driver, api, "rf-x", "uid-1", _IdleWatch())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        await sandbox.stop()  # returns: nothing untyped escapes
    assert api.deleted == 2
    assert "the sweeper reaps it" in caplog.text


async def test_a_restore_whose_copy_in_stalls_is_scratch_restore_failed_at_the_seed_budget(
    tmp_path: Path,
) -> None:
    """The restore's copy into the pod is bounded by the seed budget: a `tar -x` whose exec
    never answers ends as the typed copy error, i.e. `SCRATCH_RESTORE_FAILED` (transient), and
    `sandbox_scratch_restored` says so — the execution does not hang while its lease renews."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(4000))
    archive = tmp_path / "bank.tgz"
    make_archive(src, archive, level=1)
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    key = bank_key("run-1", "tok0")
    await blobs.put_file(key, archive)
    driver = _unreachable_driver(seed_s=0.2)
    async with silent_api_server() as url:
        api = CoreV1Api(ApiClient(Configuration(host=url)))
        watch = _IdleWatch()
        sandbox = KubernetesSandbox(driver, api, "rf-x", "uid-1", watch)  # type: ignore[arg-type]
        try:
            bank = _bank(blobs, tmp_path)
            rec = ScratchRecord(state="banked", key=key, bytes=1, progress=1)
            failed = await bank.restore(sandbox, rec, host_dir=False, stale=False)
        finally:
            watch.stop()
            await api.api_client.close()
    assert failed is not None and failed.code == FailureCode.SCRATCH_RESTORE_FAILED, failed
    assert "0.2s budget" in failed.error
    said = bank.events.said  # type: ignore[attr-defined]
    assert [(kind, data["restored"]) for kind, data in said] == [
        ("sandbox_scratch_restored", False)
    ]
