"""A `runfleet runner` on the kubernetes driver that may not manage sandbox pods stops at start,
naming what it lacks, before it takes any run (found by a Kubernetes walkthrough: a Role never
applied showed only at each run's first sandbox, as a transient refusal that parked every run
with a tool node in the DLQ). The authorizer is a local API server answering
`SelfSubjectAccessReview`s as kube-apiserver does (`tests/engine/kubernetes/test_preflight.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from store import RunStatus
from tests.engine.kubernetes.test_preflight import authorizer
from tests.publisher.conftest import example
from tests.runner.conftest import Fleet
from tests.runner.procs import spawn_runner

pytestmark = pytest.mark.asyncio


def kubeconfig(tmp: Path, url: str) -> Path:
    path = tmp / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: u, user: {}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    return path


async def test_sandbox_preflight_a_runner_that_may_not_exec_in_pods_stops_before_taking_runs(
    fleet: Fleet,
) -> None:
    run = await fleet.publisher.launch(example("hello.yaml"), {}, tenant="default")
    async with authorizer({("create", "pods/exec")}) as (url, asked):
        env = {
            "RUNFLEET_SANDBOX": "kubernetes",
            "RUNFLEET_SANDBOX_NAMESPACE": "runfleet-sandboxes",
            "RUNFLEET_SANDBOX_IMAGE": "busybox:1.36",
            "KUBECONFIG": str(kubeconfig(fleet.tmp, url)),
        }
        proc = spawn_runner(fleet, fleet.tmp / "denied.log", env=env)
        try:
            code = await asyncio.wait_for(asyncio.to_thread(proc.proc.wait), timeout=60)
        finally:
            proc.kill()
    log = (fleet.tmp / "denied.log").read_text()
    assert code != 0, log
    assert "sandbox_access_denied" in log
    assert "may not create pods/exec (no RBAC policy matched) in sandbox namespace" in log
    assert "'runfleet-sandboxes'" in log and "Unclosed" not in log
    assert "slots, http" not in log  # never reached its start line: it served nothing
    assert {a["verb"] for a in asked} >= {"create", "delete"}
    after = await fleet.store.get_run(run.run_id)
    assert (after.status, after.lease) == (RunStatus.QUEUED, None)  # left for a runner that may
