"""`runfleet runner` started with exactly the environment an overlay's ConfigMap gives a pod
(issue 16 item 1, SPEC §11, §12): render the overlay with `kubectl kustomize`, read the generated
ConfigMap's data, and start the real CLI as a subprocess with those variables and no other
`RUNFLEET_*` one, except for what the cluster provides outside the ConfigMap:

- `RUNFLEET_NATS_URL`: a local three-server JetStream cluster (enough for production's stream
  replicas 3) instead of the in-cluster service;
- `RUNFLEET_STORE_URL`: a SQLite file (in the pod: the `runfleet-store` Secret);
- `RUNFLEET_DATA`: a temporary directory (in the pod: the `data` emptyDir mounted there);
- `KUBECONFIG`: the fake API server (kmock + the exec test server) instead of the pod's
  ServiceAccount.

The streams are created first by `runfleet streams ensure --json` with the same environment, as
the Job does; then the runner must answer 200 on `/readyz` (NATS connected, store reachable, not
draining) and drain to exit 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.deploy.manifests import (
    BUILDS,
    config_map_of,
    kubectl_binary,
    kustomize_build,
    only_container,
    runner_deployment,
)
from tests.engine.kubernetes.cluster import Cluster as FakeApiServer
from tests.engine.kubernetes.cluster import fake_cluster
from tests.runner.conftest import eventually
from tests.runner.procs import READY, RUNFLEET
from tests.support.nats_cluster import Cluster, nats_cluster

__all__ = ["nats_cluster"]  # the module-scoped fixture, imported for pytest


def configmap_data(build: str) -> dict[str, str]:
    manifests = kustomize_build(kubectl_binary(), BUILDS[build])
    container = only_container(runner_deployment(manifests))
    data: dict[str, str] = dict(config_map_of(manifests, container)["data"])
    return data


@pytest.fixture
async def api_server(tmp_path: Path) -> AsyncIterator[tuple[FakeApiServer, Path]]:
    async with fake_cluster(tmp_path / "pods") as api:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: k, cluster: {{server: '{api.url}'}}}}]\n"
            "users: [{name: u, user: {}}]\n"
            "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        )
        yield api, kubeconfig


@pytest.fixture
def fresh_streams(nats_cluster: Cluster) -> Iterator[Cluster]:
    """The ConfigMaps use the default (unprefixed) stream names: remove them after each test,
    so each overlay's `streams ensure` creates them with its own replicas."""
    yield nats_cluster

    async def delete_all() -> None:
        async with nats_cluster.client() as (_, js):
            for info in await js.streams_info():
                await js.delete_stream(info.config.name or "")

    asyncio.run(delete_all())


def pod_env(data: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """This process's environment without any RUNFLEET_* variable, then the ConfigMap, then
    what the pod gets from elsewhere (Secrets, mounts, its ServiceAccount)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    base.pop("KUBERNETES_SERVICE_HOST", None)
    return {**base, **data, **overrides, "PYTHONUNBUFFERED": "1"}


def spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """`runfleet ARGS`, its stdout and stderr to `log_path`, not waited for."""
    with log_path.open("wb") as log_file:
        return subprocess.Popen(
            [str(RUNFLEET), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


async def streams_ensure(env: dict[str, str]) -> None:
    """`runfleet streams ensure --json` with `env`, as the streams Job runs it; it must pass."""
    ensure = await asyncio.to_thread(
        subprocess.run,
        [str(RUNFLEET), "streams", "ensure", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ensure.returncode == 0, ensure.stdout + ensure.stderr


def get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code)


@pytest.mark.parametrize("build", list(BUILDS))
async def test_runner_becomes_ready_with_exactly_the_configmaps_environment(
    build: str,
    fresh_streams: Cluster,
    api_server: tuple[FakeApiServer, Path],
    tmp_path: Path,
) -> None:
    data = await asyncio.to_thread(configmap_data, build)
    overridden = {"RUNFLEET_NATS_URL", "RUNFLEET_STORE_URL", "RUNFLEET_DATA"}
    overrides = {
        "RUNFLEET_NATS_URL": fresh_streams.url,
        "RUNFLEET_STORE_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        "RUNFLEET_DATA": str(tmp_path / "data"),
        "KUBECONFIG": str(api_server[1]),
    }
    env = pod_env(data, overrides)
    runfleet_env = {k for k in env if k.startswith("RUNFLEET_")}
    assert runfleet_env == set(data) | overridden  # nothing else reaches the process
    if build != "dev":
        assert data["RUNFLEET_SANDBOX"] == "kubernetes"

    await streams_ensure(env)

    log_path = tmp_path / "runner.log"
    proc = spawn(["runner"], env, log_path)
    try:

        async def started() -> int | None:
            found = READY.search(log_path.read_text(errors="replace"))
            if found:
                return int(found["port"])
            if proc.poll() is not None:
                raise AssertionError(f"runner exited {proc.returncode}:\n{log_path.read_text()}")
            return None

        port = await eventually(started, within=60)
        assert f"{data['RUNFLEET_SLOTS']} slots" in log_path.read_text()

        async def ready() -> bool:
            return await asyncio.to_thread(get, port, "/readyz") == 200

        await eventually(ready, within=30)
        assert await asyncio.to_thread(get, port, "/healthz") == 200
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
        assert code == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
