"""The continuity watch against a scripted API server (SPEC §7.2).

`FakePodsApi` (fake_pods_api.py) is served by aiohttp on 127.0.0.1 to the real `kubernetes.aio`
client; each watch request becomes a `WatchCall` the test scripts (send an event, end the stream,
abort the connection, send a 410 ERROR). Every wait is on a queue or an event with a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from kubernetes.aio import client

from engine.sandbox.kubernetes import watch as watch_module
from engine.sandbox.kubernetes.watch import PodWatch, judge_event, judge_pod
from tests.engine.kubernetes.fake_pods_api import (
    NAME,
    NS,
    UID,
    WAIT_S,
    FakePodsApi,
    pod,
    pod_dict,
)

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
