"""The continuity watch against a scripted API server, and the pod-side quiesce (SPEC §7.2, §7.3).

`FakePodsApi` is a small aiohttp server on 127.0.0.1 that serves the pod list and `?watch=1`
streams (newline-delimited JSON watch events) to the real `kubernetes.aio` client: each watch
request becomes a `WatchCall` the test scripts (send an event, end the stream, abort the
connection, send a 410 ERROR). Every wait is on a queue or an event with a deadline.

The quiesce runs in a fresh user + PID namespace (`unshare`), like a container: it must never see,
let alone stop, the host's processes.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from kubernetes.aio import client

from engine.sandbox.kubernetes import watch as watch_module
from engine.sandbox.kubernetes.watch import (
    PodWatch,
    judge_event,
    judge_pod,
    parse_quiesce_report,
    quiesce_command,
    quiesce_script,
)

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


# -- judge_pod: the decision as a table ----------------------------------------------------------

JUDGE_ROWS: list[tuple[str, dict[str, Any] | None, str | None]] = [
    ("absent", None, "deleted"),
    ("running and ready", {}, None),
    ("pending", {"phase": "Pending", "ready": "False"}, None),
    ("ready gone false (probe, or an unreachable node): unknown", {"ready": "False"}, None),
    ("phase Unknown without NodeLost: unknown", {"phase": "Unknown", "ready": "Unknown"}, None),
    ("another UID", {"uid": "uid-other"}, "replaced"),
    ("another UID wins over its phase", {"uid": "x", "phase": "Failed"}, "replaced"),
    ("evicted: Failed, same UID", {"phase": "Failed", "reason": "Evicted"}, "evicted"),
    (
        "failed: its container ended",
        {"phase": "Failed", "terminated": ("OOMKilled", 137)},
        "failed",
    ),
    ("succeeded", {"phase": "Succeeded", "ready": "False"}, "succeeded"),
    ("terminating", {"deleting": True, "disruption": "DeletionByTaintManager"}, "deleted"),
    ("node lost, phase Unknown", {"phase": "Unknown", "reason": "NodeLost"}, "node_lost"),
    ("node lost while terminating", {"reason": "NodeLost", "deleting": True}, "node_lost"),
]


@pytest.mark.parametrize(("case", "fields", "expected"), JUDGE_ROWS, ids=[r[0] for r in JUDGE_ROWS])
def test_judge_pod_loss_is_deleted_failed_succeeded_or_another_uid(
    case: str, fields: dict[str, Any] | None, expected: str | None
) -> None:
    loss = judge_pod(None if fields is None else pod(**fields), UID)
    assert (loss.reason if loss else None) == expected, case
    if loss is not None:
        assert loss.message


def test_judge_pod_message_says_why_the_pod_ended() -> None:
    loss = judge_pod(pod(phase="Failed", terminated=("OOMKilled", 137)), UID)
    assert loss is not None and "container main OOMKilled (exit 137)" in loss.message
    loss = judge_pod(pod(phase="Failed", reason="Evicted", message="low on memory"), UID)
    assert loss is not None and "Evicted; low on memory" in loss.message


def test_judge_event_deleted_of_our_uid_is_deleted_even_if_the_pod_looked_healthy() -> None:
    loss = judge_event("DELETED", pod(), UID)
    assert loss is not None and loss.reason == "deleted"
    assert judge_event("MODIFIED", pod(), UID) is None
    replaced = judge_event("DELETED", pod(uid="uid-old"), UID)
    assert replaced is not None and replaced.reason == "replaced"


# -- the scripted API server ---------------------------------------------------------------------


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


@dataclass
class Harness:
    api: FakePodsApi
    core: client.CoreV1Api
    watch: PodWatch
    task: asyncio.Task[None]

    async def lost(self) -> tuple[str | None, str | None]:
        await asyncio.wait_for(self.watch.lost.wait(), WAIT_S)
        return self.watch.reason, self.watch.message


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    fake = FakePodsApi()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods", fake.pods)
    # handler_cancellation: a client that lets a stream go ends its handler (`WatchCall.closed`)
    runner = web.AppRunner(app, shutdown_timeout=1.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    config = client.Configuration(host=f"http://{host}:{port}")
    api_client = client.ApiClient(config)
    core = client.CoreV1Api(api_client)
    watch = PodWatch(core, NS, NAME, UID)
    task = asyncio.create_task(watch.run())
    try:
        yield Harness(fake, core, watch, task)
    finally:
        watch.stop()
        await asyncio.wait_for(task, WAIT_S)
        for call in fake.open_calls:
            call.end()
        await api_client.close()  # type: ignore[no-untyped-call]
        await runner.cleanup()


# -- the watch against the scripted stream -------------------------------------------------------


async def test_watch_lists_by_name_then_watches_from_the_lists_resource_version(
    harness: Harness,
) -> None:
    call = await harness.api.next_watch()
    assert harness.api.lists[0]["fieldSelector"] == f"metadata.name={NAME}"
    assert call.query["fieldSelector"] == f"metadata.name={NAME}"
    assert call.query["resourceVersion"] == str(harness.api.resource_version)
    assert not harness.watch.lost.is_set()


async def test_watch_deleted_pod_is_sandbox_lost_deleted(harness: Harness) -> None:
    call = await harness.api.next_watch()
    call.send("MODIFIED", pod_dict(deleting=True))
    reason, message = await harness.lost()
    assert reason == "deleted"
    assert message is not None and NAME in message and "being deleted" in message


async def test_watch_deleted_event_is_sandbox_lost_deleted(harness: Harness) -> None:
    call = await harness.api.next_watch()
    call.send("DELETED", pod_dict())
    assert (await harness.lost())[0] == "deleted"


async def test_watch_eviction_failed_same_uid_is_sandbox_lost_evicted(harness: Harness) -> None:
    call = await harness.api.next_watch()
    evicted = pod_dict(phase="Failed", reason="Evicted", message="The node was low on memory.")
    call.send("MODIFIED", evicted)
    reason, message = await harness.lost()
    assert reason == "evicted"
    assert message is not None and "low on memory" in message


async def test_watch_node_lost_counts_only_when_the_control_plane_says_nodelost(
    harness: Harness,
) -> None:
    """An unreachable node first shows as Ready=False, then phase Unknown: both are *unknown*
    (the lease decides). The node controller's `NodeLost` (with the taint manager's deletion)
    is the statement that the node is gone: loss. The first loss wins, so a reason of
    `node_lost` proves the earlier events were not read as loss."""
    call = await harness.api.next_watch()
    call.send("MODIFIED", pod_dict(ready="False"))
    call.send("MODIFIED", pod_dict(phase="Unknown", ready="Unknown"))
    call.send(
        "MODIFIED",
        pod_dict(
            phase="Unknown",
            reason="NodeLost",
            message="Node n1 which was running pod rf-run1-tok1 is unresponsive",
            deleting=True,
            disruption="DeletionByTaintManager",
        ),
    )
    reason, message = await harness.lost()
    assert reason == "node_lost"
    assert message is not None and "unresponsive" in message and "TaintManager" in message


async def test_watch_pod_of_that_name_with_another_uid_is_sandbox_lost_replaced(
    harness: Harness,
) -> None:
    call = await harness.api.next_watch()
    call.send("ADDED", pod_dict(uid="uid-second-pod"))
    assert (await harness.lost())[0] == "replaced"


async def test_watch_dropped_then_relist_finds_pod_healthy_is_not_loss(harness: Harness) -> None:
    first = await harness.api.next_watch()
    first.end()
    second = await harness.api.next_watch()
    assert len(harness.api.lists) == 2
    assert second.query["resourceVersion"] == str(harness.api.resource_version)
    assert not harness.watch.lost.is_set()
    second.abort()  # a connection error: unknown too
    third = await harness.api.next_watch()
    assert len(harness.api.lists) == 3
    assert not harness.watch.lost.is_set()
    third.send("MODIFIED", pod_dict(phase="Succeeded", ready="False"))
    assert (await harness.lost())[0] == "succeeded"  # the new watch is the live one


async def test_watch_dropped_then_relist_finds_pod_gone_is_sandbox_lost(harness: Harness) -> None:
    first = await harness.api.next_watch()
    harness.api.pod = None
    first.end()
    reason, message = await harness.lost()
    assert reason == "deleted"
    assert message is not None and "listed" in message
    assert len(harness.api.lists) == 2


async def test_watch_dropped_then_relist_finds_another_uid_is_replaced(harness: Harness) -> None:
    first = await harness.api.next_watch()
    harness.api.pod = pod_dict(uid="uid-recreated")
    first.abort()
    assert (await harness.lost())[0] == "replaced"


async def test_watch_410_gone_relists_and_is_not_loss(harness: Harness) -> None:
    first = await harness.api.next_watch()
    first.gone_410()
    second = await harness.api.next_watch()
    assert len(harness.api.lists) == 2
    assert second.query["resourceVersion"] == str(harness.api.resource_version)
    assert not harness.watch.lost.is_set()
    second.send("DELETED", pod_dict())
    assert (await harness.lost())[0] == "deleted"


async def test_watch_failed_relists_back_off_and_are_not_loss(harness: Harness) -> None:
    first = await harness.api.next_watch()
    harness.api.list_refusals = [500, 403]
    first.end()
    second = await harness.api.next_watch()
    assert harness.api.refused == [("list", 500), ("list", 403)]
    assert len(harness.api.lists) == 2
    assert not harness.watch.lost.is_set()
    second.send("DELETED", pod_dict())
    assert (await harness.lost())[0] == "deleted"


async def test_watch_refused_with_http_410_relists_and_is_not_loss(harness: Harness) -> None:
    first = await harness.api.next_watch()
    harness.api.watch_refusals = [410]
    first.end()
    await harness.api.next_watch()
    assert harness.api.refused == [("watch", 410)]
    assert len(harness.api.lists) == 3
    assert not harness.watch.lost.is_set()


async def test_watch_silent_half_open_stream_is_relisted_after_the_client_timeout(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake never ends the stream (as a dead peer would not): the client's total timeout
    (server timeout + margin, 1 s here) ends it, and that is unknown: re-list, no loss."""
    monkeypatch.setattr(watch_module, "WATCH_TIMEOUT_S", 1)
    monkeypatch.setattr(watch_module, "_CLIENT_MARGIN_S", 0.0)
    first = await harness.api.next_watch()
    first.end()
    silent = await harness.api.next_watch()
    assert silent.query["timeoutSeconds"] == "1"
    await harness.api.next_watch()
    assert len(harness.api.lists) == 3
    assert not harness.watch.lost.is_set()


async def test_watch_exec_in_flight_is_abandoned_within_2s_of_the_loss_event(
    harness: Harness,
) -> None:
    call = await harness.api.next_watch()
    exec_task = asyncio.create_task(asyncio.Event().wait(), name="exec-in-flight")
    lost_task = asyncio.create_task(harness.watch.lost.wait())
    call.send("DELETED", pod_dict())
    done, _ = await asyncio.wait(
        {exec_task, lost_task}, timeout=WAIT_S, return_when="FIRST_COMPLETED"
    )
    abandoned_at = asyncio.get_running_loop().time()
    assert done == {lost_task}
    assert abandoned_at - call.sent_at[0] < 2.0
    exec_task.cancel()
    assert harness.watch.reason == "deleted"


async def test_watch_after_loss_run_idles_until_stop(harness: Harness) -> None:
    call = await harness.api.next_watch()
    call.send("DELETED", pod_dict())
    await harness.lost()
    await asyncio.wait_for(call.closed.wait(), WAIT_S)  # the stream is let go at once
    assert not harness.task.done()
    harness.watch.stop()
    await asyncio.wait_for(harness.task, WAIT_S)


async def test_watch_stop_ends_run_and_closes_the_stream_without_loss(harness: Harness) -> None:
    call = await harness.api.next_watch()
    harness.watch.stop()
    await asyncio.wait_for(harness.task, WAIT_S)
    await asyncio.wait_for(call.closed.wait(), WAIT_S)
    assert not harness.watch.lost.is_set()


async def test_watch_initial_list_without_the_pod_is_loss_at_once(harness: Harness) -> None:
    # the harness started watching already; a second watch on a missing pod judges its list
    harness.api.pod = None
    watch = PodWatch(harness.core, NS, NAME, UID)
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.wait_for(watch.lost.wait(), WAIT_S)
        assert watch.reason == "deleted"
    finally:
        watch.stop()
        await asyncio.wait_for(task, WAIT_S)


# -- the quiesce before the bank (§7.3) -----------------------------------------------------------

needs_unshare = pytest.mark.skipif(
    shutil.which("unshare") is None
    or subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"], check=False).returncode != 0,
    reason="needs unprivileged user + PID namespaces (unshare -Urpf)",
)

_TREE = r"""
sleep 300 & a=$!
sh -c 'while :; do :; done' & b=$!
sh -c 'sleep 300 & wait' & c=$!
@RUN@
echo "rc=$?"
for p in $a $b $c; do read -r l < /proc/$p/stat; s=${l##*) }; echo "state ${s%% *}"; done
echo "alive"
"""


def _in_pid_namespace(run: str, quiesce: str) -> subprocess.CompletedProcess[str]:
    """The tree as a pod: PID 1 is the shell that started it (the pause process's place); `run`
    finds the quiesce script in `$Q`."""
    argv = ["unshare", "-Urpf", "--mount-proc", "sh", "-c", _TREE.replace("@RUN@", run)]
    env = {"Q": quiesce, "PATH": "/usr/bin:/bin"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, env=env)


def _states(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.split()[1] for line in result.stdout.splitlines() if line.startswith("state")]


@needs_unshare
def test_quiesce_stops_every_process_of_the_pod_except_its_own() -> None:
    """`quiesce_command` as an exec of its own; the tar runs after it."""
    sh, dash_c, script = quiesce_command()
    result = _in_pid_namespace(f'{sh} {dash_c} "$Q"', script)
    assert _states(result) == ["T", "T", "T"], result
    assert parse_quiesce_report(result.stderr).quiesced, result
    assert "alive" in result.stdout  # PID 1 (the pod's init) was left alone


@needs_unshare
def test_quiesce_as_a_prefix_keeps_the_tar() -> None:
    """`<script>; exec tar ...`: `$$` is the shell that becomes the tar, and it runs."""
    result = _in_pid_namespace('sh -c "$Q; exec echo tar-ran"', quiesce_script("$$"))
    assert "tar-ran" in result.stdout, result
    assert _states(result) == ["T", "T", "T"], result
    assert parse_quiesce_report(result.stderr).quiesced, result


@needs_unshare
def test_quiesce_that_could_not_stop_a_process_reports_unquiesced() -> None:
    """A process the quiesce may not signal (another user's, in the real pod) stays running: a
    `kill` that fails stands in for EPERM, and the report names what was left."""
    result = _in_pid_namespace('sh -c "kill() { return 1; }; $Q"', quiesce_script())
    report = parse_quiesce_report(result.stderr)
    assert not report.quiesced, result
    assert any(" sleep" in u for u in report.unstopped), report
    assert "T" not in _states(result)


def test_quiesce_report_without_done_is_unquiesced() -> None:
    assert not parse_quiesce_report("sh: not found\n").quiesced
    assert not parse_quiesce_report("runfleet-quiesce: no-proc\n").quiesced
    assert parse_quiesce_report("runfleet-quiesce: done unstopped=0\n").quiesced


def test_quiesce_keep_pid_is_a_pid_or_a_variable_never_shell_text() -> None:
    assert "keep=$TAR_PID;" in quiesce_script("$TAR_PID")
    assert "keep=42;" in quiesce_script("42")
    with pytest.raises(ValueError):
        quiesce_script("1; rm -rf /")
