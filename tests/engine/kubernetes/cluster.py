"""A fake cluster for the driver's tests: kmock's `KubernetesEmulator` for the pod API (create,
read, list, delete, watch) fronted by the local exec server (`tests.support.exec_server`) for
the exec subresource, on one 127.0.0.1 port; and `Kubelet`, which scripts each pod's status the
way a node would (kmock stores pods but runs nothing). kmock ignores label and field selectors:
the driver filters client-side too, and these tests rely on it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
from kubernetes.aio.client import ApiClient, Configuration, CoreV1Api

from tests.support.exec_server import ExecServer

NAMESPACE = "sandboxes"

Script = Callable[[dict[str, Any]], dict[str, Any] | None]
"""A pod's manifest → the status patch to apply now (`None`: leave it as it is)."""


def ready(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True"},
        ],
        "containerStatuses": [_status("sandbox", {"running": {}}, ready=True)],
    }


def unschedulable(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient cpu.",
            }
        ],
    }


def waiting(reason: str, phase: str = "Pending") -> Script:
    def script(pod: dict[str, Any]) -> dict[str, Any]:
        return {
            "phase": phase,
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                _status("sandbox", {"waiting": {"reason": reason, "message": f"{reason}!"}})
            ],
        }

    return script


def never_ready(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "False"},
        ],
        "containerStatuses": [_status("sandbox", {"running": {}})],
    }


def _status(name: str, state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "image": "img",
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "state": state,
    }


@dataclass
class Kubelet:
    """Gives every new pod a UID and applies `script` to it until the pod is deleted."""

    emulator: kmock.KubernetesEmulator
    script: Script = ready
    uids: dict[str, str] = field(default_factory=dict)
    _count: itertools.count[int] = field(default_factory=itertools.count)

    def tick(self) -> None:
        for (resource, _ns, name), obj in list(self.emulator.objects.items()):
            if resource.plural != "pods" or obj.deleted:
                continue
            raw = obj.raw
            patch: dict[str, Any] = {}
            uid = raw.get("metadata", {}).get("uid")
            if not uid:
                uid = f"uid-{next(self._count)}"
                patch["metadata"] = {"uid": uid}
            self.uids[name] = uid
            status = self.script(raw)
            if status is not None and status != raw.get("status"):
                patch["status"] = status
            if patch:
                obj.patch(patch)

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(0.02)


@dataclass
class Cluster:
    emulator: kmock.KubernetesEmulator
    exec_server: ExecServer
    kubelet: Kubelet
    url: str

    def api_client(self) -> ApiClient:
        return ApiClient(Configuration(host=self.url))

    async def api_factory(self) -> ApiClient:
        return self.api_client()

    def pods(self) -> dict[str, dict[str, Any]]:
        """The live pods, by name."""
        return {
            name: obj.raw
            for (resource, _ns, name), obj in self.emulator.objects.items()
            if resource.plural == "pods" and not obj.deleted
        }

    async def delete(self, name: str) -> None:
        """What `kubectl delete pod` does to it: the API object goes, the node kills it."""
        async with self.api_client() as api_client:
            await CoreV1Api(api_client).delete_namespaced_pod(name, NAMESPACE)
        self.exec_server.delete_pod(NAMESPACE, name)


@contextlib.asynccontextmanager
async def fake_cluster(root: Path) -> AsyncIterator[Cluster]:
    async with (
        kmock.KubernetesEmulator() as emulator,
        ExecServer(root, fallback=emulator, orphans=True) as exec_server,  # as a kubelet
    ):
        emulator.resources["v1/pods"] = kmock.ResourceInfo()  # listable before the first pod
        kubelet = Kubelet(emulator)
        task = asyncio.create_task(kubelet.run())
        try:
            yield Cluster(emulator, exec_server, kubelet, exec_server.url)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            _end_lingering_streams()


def _end_lingering_streams() -> None:
    """kmock's watch handler waits on its event bus after its client left (aiohttp does not
    cancel a handler on disconnect), which would hold the server's shutdown for its 60 s
    timeout: end those handlers, as a real API server ends a watch whose client is gone."""
    for task in asyncio.all_tasks():
        if task.get_coro().__qualname__ == "RequestHandler._handle_request":  # type: ignore[union-attr]
            task.cancel()


@contextlib.asynccontextmanager
async def silent_api_server() -> AsyncIterator[str]:
    """An API server that accepts every connection and never answers a byte (a stalled node,
    a hung exec): its URL. A connection lasts until its client hangs up."""
    held: set[asyncio.Task[None]] = set()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        held.add(task)
        try:
            while await reader.read(65536):  # the request, then nothing: until the client leaves
                pass
        finally:
            writer.close()
            held.discard(task)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for task in list(held):
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await server.wait_closed()
