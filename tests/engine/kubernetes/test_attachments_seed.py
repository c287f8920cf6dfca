"""The kubernetes driver copies a run's attachments into the pod, read-only, at
`/run/runfleet/attachments/` during its seed phase (SPEC §8, §7.1), through the engine's one
attachments path: the fake cluster (kmock + a real exec server running real shell commands).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.outcome import Finished
from engine.sandbox.kubernetes.driver import KubernetesSandboxDriver
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.protocols import SetupBudgets
from store import RunStore
from store.blobs_fs import FilesystemBlobStore
from tests.engine.conftest import all_events
from tests.engine.kubernetes.cluster import NAMESPACE, Cluster, fake_cluster
from tests.engine.test_attachments import SPEC_BYTES, _execute, _held_run, _load

WORKFLOW = """\
name: seeded
entry: read
nodes:
  read:
    kind: tool
    run: >-
      echo {{ attachments.spec.path }};
      sha256sum < {{ attachments.spec.path }};
      stat -c %a {{ attachments.spec.path }}
    output: text
"""


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with fake_cluster(tmp_path / "pods") as c:
        yield c


async def test_kubernetes_copies_attachments_read_only_into_run_runfleet_attachments(
    store: RunStore, cluster: Cluster, tmp_path: Path
) -> None:
    settings = KubernetesSettings(
        namespace=NAMESPACE,
        image="busybox:1.36",
        budgets=SetupBudgets(schedule_s=5, ready_s=5, seed_s=10),
        delete_grace_s=0,
        gone_timeout_s=5,
    )
    driver = KubernetesSandboxDriver(settings, api_factory=cluster.api_factory, poll_s=0.02)
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    run, token = await _held_run(store, blobs, _load(tmp_path, WORKFLOW))
    try:
        outcome, _ = await _execute(store, run, token, tmp_path, blobs, lambda _: driver)
    finally:
        await driver.close()

    assert isinstance(outcome, Finished), outcome
    doc = await store.get_run(run.run_id)
    assert doc.checkpoint is not None
    path, digest, _, mode = doc.checkpoint.outputs["read"].split()
    # The exec server roots the pod's emptyDirs under its directory, so the path ends so.
    assert path.endswith("/run/runfleet/attachments/spec/spec.bin"), path
    assert digest == hashlib.sha256(SPEC_BYTES).hexdigest()
    assert mode == "444"
    events = await all_events(store, run.run_id)
    assert [e.data for e in events if e.type == "attachments_seeded"] == [
        {"names": ["spec"], "bytes": len(SPEC_BYTES)}
    ]
