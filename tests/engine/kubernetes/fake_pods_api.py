"""A scripted pod API for the continuity watch's tests (SPEC §7.2): an aiohttp handler that
serves `GET /api/v1/namespaces/{ns}/pods` lists and `?watch=1` streams (newline-delimited JSON
watch events) to the real `kubernetes.aio` client. Each watch request becomes a `WatchCall` the
test scripts: send an event, end the stream, abort the connection, send a 410 ERROR.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from kubernetes.aio import client

NS = "runs"
NAME = "rf-run1-tok1"
UID = "uid-started"
WAIT_S = 5.0


def pod_dict(
    *,
    uid: str = UID,
    phase: str = "Running",
    reason: str | None = None,
    message: str | None = None,
    ready: str = "True",
    deleting: bool = False,
    disruption: str | None = None,
    terminated: tuple[str, int] | None = None,
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = [{"type": "Ready", "status": ready}]
    if disruption:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    meta: dict[str, Any] = {"name": NAME, "namespace": NS, "uid": uid, "resourceVersion": "7"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T12:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if terminated:
        ended = {"reason": terminated[0], "exitCode": terminated[1]}
        status["containerStatuses"] = [
            {
                "name": "main",
                "image": "busybox",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": ended},
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
        "status": status,
    }


def pod(**kw: Any) -> client.V1Pod:
    return client.V1Pod.model_validate(pod_dict(**kw))


@dataclass
class WatchCall:
    query: dict[str, str]
    actions: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    sent_at: list[float] = field(default_factory=list)

    def send(self, kind: str, obj: dict[str, Any]) -> None:
        self.actions.put_nowait(("event", {"type": kind, "object": obj}))

    def gone_410(self) -> None:
        status = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410}
        status["message"] = "too old resource version"
        self.actions.put_nowait(("event", {"type": "ERROR", "object": status}))

    def end(self) -> None:
        self.actions.put_nowait(("end", None))

    def abort(self) -> None:
        self.actions.put_nowait(("abort", None))


class FakePodsApi:
    def __init__(self) -> None:
        self.pod: dict[str, Any] | None = pod_dict()
        self.resource_version = 100
        self.lists: list[dict[str, str]] = []
        self.watches: asyncio.Queue[WatchCall] = asyncio.Queue()
        self.open_calls: list[WatchCall] = []
        self.list_refusals: list[int] = []
        self.watch_refusals: list[int] = []
        """HTTP statuses to answer the next lists / watch requests with, in order."""
        self.refused: list[tuple[str, int]] = []

    async def pods(self, request: web.Request) -> web.StreamResponse:
        assert request.match_info["ns"] == NS
        query = dict(request.query)
        watching = query.get("watch") in ("true", "True", "1")
        refusals = self.watch_refusals if watching else self.list_refusals
        if refusals:
            code = refusals.pop(0)
            self.refused.append(("watch" if watching else "list", code))
            status = {"kind": "Status", "status": "Failure", "code": code, "message": "refused"}
            return web.json_response(status, status=code)
        if watching:
            return await self._watch(request, query)
        self.resource_version += 1
        self.lists.append(query)
        return web.json_response(
            {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": [self.pod] if self.pod is not None else [],
            }
        )

    async def _watch(self, request: web.Request, query: dict[str, str]) -> web.StreamResponse:
        call = WatchCall(query)
        self.open_calls.append(call)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self.watches.put_nowait(call)
        try:
            while True:
                kind, payload = await call.actions.get()
                if kind == "end":
                    await response.write_eof()
                    return response
                if kind == "abort":
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                call.sent_at.append(asyncio.get_running_loop().time())
                await response.write(json.dumps(payload).encode() + b"\n")
        finally:
            call.closed.set()

    async def next_watch(self) -> WatchCall:
        return await asyncio.wait_for(self.watches.get(), WAIT_S)
