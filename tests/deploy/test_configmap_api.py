"""`runfleet console` started as the API Deployment starts it (issue 22 item 2; SPEC v2.2 §10c,
§11): the container's own argv (only `--port` made 0: no fixed ports in tests) and exactly the
environment the overlay gives the pod — its ConfigMap and its literal `env` — with no other
`RUNFLEET_*` variable except what the cluster provides outside the manifests:

- `RUNFLEET_NATS_URL`: the session's nats-server (the in-cluster service; production's NATS
  credential and CA files, mounted Secrets, are left out with it);
- `RUNFLEET_STORE_URL`, `RUNFLEET_BLOB_URL`: one SQLite file and one blob directory that both
  replicas share (in the pod: the `runfleet-store` and `runfleet-blobs` Secrets);
- `RUNFLEET_API_TOKENS`: a tokens file (in the pod: the `runfleet-api-tokens` Secret);
- `RUNFLEET_DATA`: a directory per replica (in the pod: an emptyDir);
- `RUNFLEET_NAMESPACE`: a uuid prefix for the streams, so this test shares the server safely.

Two replicas serve at once: a launch on one is seen by the other, and a launch retried on the
other with the same `Idempotency-Key` returns the first run — the API keeps no state of its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from runner.console.auth import TOKENS_FILE
from tests.deploy.manifests import (
    BUILDS,
    OVERLAYS,
    SECRET_FILE_SETTINGS,
    api_deployment,
    container_argv,
    kubectl_binary,
    kustomize_build,
    only_container,
    workload_env,
)
from tests.deploy.test_configmap_runner import pod_env, spawn, streams_ensure
from tests.runner.conftest import eventually
from tests.support.nats_server import NatsServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LISTENING = re.compile(r"runfleet API on http://\S+:(?P<port>\d+)")
TOKEN = "deploy-test-token"


def api_pod(build: str) -> tuple[list[str], dict[str, str]]:
    """The API container's `runfleet` arguments (port 0) and its literal environment."""
    manifests = kustomize_build(kubectl_binary(), BUILDS[build])
    argv = container_argv(only_container(api_deployment(manifests)))
    args = argv[[Path(word).name for word in argv].index("runfleet") + 1 :]
    args[args.index("--port") + 1] = "0"
    env = workload_env(manifests, "api")
    return args, {k: v for k, v in env.items() if k not in SECRET_FILE_SETTINGS}


def request(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers or {}
    )
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read())


@pytest.mark.parametrize("build", OVERLAYS)
async def test_api_replicas_serve_from_the_pods_environment_and_share_no_state(
    build: str, nats_server: NatsServer, nats_prefix: str, tmp_path: Path
) -> None:
    args, pod = await asyncio.to_thread(api_pod, build)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} default operate\n")
    shared = {
        "RUNFLEET_NATS_URL": nats_server.url,
        "RUNFLEET_STORE_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        "RUNFLEET_BLOB_URL": f"file://{tmp_path / 'blobs'}",
        "RUNFLEET_NAMESPACE": nats_prefix,
        TOKENS_FILE: str(tokens),
    }
    # The streams Job's work, on this one-server NATS.
    await streams_ensure(pod_env(pod, {**shared, "RUNFLEET_STREAM_REPLICAS": "1"}))

    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for replica in ("a", "b"):
            env = pod_env(pod, {**shared, "RUNFLEET_DATA": str(tmp_path / replica)})
            assert {k for k in env if k.startswith("RUNFLEET_")} == set(pod) | set(shared) | {
                "RUNFLEET_DATA"
            }
            logs.append(tmp_path / f"api-{replica}.log")
            procs.append(spawn(args, env, logs[-1]))
        ports = [await listening(proc, log) for proc, log in zip(procs, logs, strict=True)]
        a, b = ports
        auth = {"Authorization": f"Bearer {TOKEN}"}

        for port in ports:  # what the kubelet's probes and an anonymous caller see
            assert await asyncio.to_thread(request, port, "GET", "/healthz") == (
                200,
                {"status": "ok"},
            )
            assert await asyncio.to_thread(request, port, "GET", "/readyz") == (
                200,
                {"ok": True, "problems": []},
            )
            status, body = await asyncio.to_thread(request, port, "GET", "/api/v1/runs")
            assert (status, body["error"]["code"]) == (401, "unauthorized")

        launch = {"workflow": (EXAMPLES / "hello.yaml").read_text()}
        key = {**auth, "Idempotency-Key": f"deploy-{nats_prefix}"}
        status, first = await asyncio.to_thread(request, a, "POST", "/api/v1/runs", launch, key)
        assert status == 201, first
        status, again = await asyncio.to_thread(request, b, "POST", "/api/v1/runs", launch, key)
        assert (status, again["run_id"]) == (200, first["run_id"])
        status, shown = await asyncio.to_thread(
            request, b, "GET", f"/api/v1/runs/{first['run_id']}", None, auth
        )
        assert (status, shown["status"]) == (200, "queued")

        for proc, log in zip(procs, logs, strict=True):  # a pod stopped: SIGTERM, exit 0
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            assert code == 0, log.read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


async def listening(proc: subprocess.Popen[bytes], log: Path) -> int:
    """The port a replica announced (`runfleet API on URL`), once it listens."""

    def announced() -> int | None:
        text = log.read_text(errors="replace")
        found = LISTENING.search(text)
        if found:
            return int(found["port"])
        if proc.poll() is not None:
            raise AssertionError(f"the API exited {proc.returncode}:\n{text}")
        return None

    async def port() -> int | None:
        return await asyncio.to_thread(announced)

    return await eventually(port, within=60)
