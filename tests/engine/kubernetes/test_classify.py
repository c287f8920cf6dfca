"""Start-failure classification as a table over pod objects (SPEC §7.1): one row per case, pods
built with the client's `V1Pod` model, each failure naming its phase, elapsed time and budget."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.aio.client import CoreV1Event, V1Pod

from engine.failures import FailureCode
from engine.sandbox.kubernetes.classify import (
    Phase,
    StartFailure,
    Verdict,
    classify_create_error,
    classify_start,
)
from engine.sandbox.protocols import SetupBudgets

BUDGETS = SetupBudgets(schedule_s=300, ready_s=120, seed_s=60)
UID = "uid-1"


def pod(
    phase: str = "Pending",
    *,
    scheduled: bool | None = None,
    unschedulable: str | None = None,
    waiting: str | None = None,
    init_waiting: str | None = None,
    running: bool = False,
    terminated: int | None = None,
    ready: bool = False,
    reason: str | None = None,
    uid: str = UID,
    deleting: bool = False,
) -> V1Pod:
    conditions: list[dict[str, Any]] = []
    if unschedulable is not None:
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
            }
        )
    elif scheduled:
        conditions.append({"type": "PodScheduled", "status": "True"})
    if ready or running:
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    state: dict[str, Any] | None = None
    if waiting is not None:
        state = {"waiting": {"reason": waiting, "message": f"{waiting} detail"}}
    elif terminated is not None:
        state = {"terminated": {"exitCode": terminated, "reason": "Error"}}
    elif running or ready:
        state = {"running": {}}
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if reason is not None:
        status["reason"] = reason
        status["message"] = "The node was low on resource: memory."
    if state is not None:
        status["containerStatuses"] = [
            {
                "name": "sandbox",
                "image": "img",
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "state": state,
            }
        ]
    if init_waiting is not None:
        status["initContainerStatuses"] = [
            {
                "name": "init",
                "image": "img",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": init_waiting}},
            }
        ]
    meta: dict[str, Any] = {"name": "rf-pod", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return V1Pod.model_validate(
        {
            "metadata": meta,
            "spec": {"containers": [{"name": "sandbox", "image": "img"}]},
            "status": status,
        }
    )


PULL_EVENT = CoreV1Event.model_validate(
    {
        "metadata": {"name": "e"},
        "involvedObject": {"name": "rf-pod"},
        "reason": "Failed",
        "message": 'Failed to pull image "nope:1": not found',
    }
)

# (case, pod, phase, elapsed, events, expected code or verdict)
ROWS: list[tuple[str, V1Pod | None, Phase, float, list[CoreV1Event], object]] = [
    (
        "pending unscheduled within the budget: wait",
        pod(unschedulable="0/3 nodes"),
        "schedule",
        10,
        [],
        None,
    ),
    (
        "pending unscheduled past the schedule budget",
        pod(unschedulable="0/3 nodes: cpu"),
        "schedule",
        301,
        [],
        FailureCode.SANDBOX_CAPACITY,
    ),
    (
        "pending, no condition yet, past the schedule budget",
        pod(),
        "schedule",
        301,
        [],
        FailureCode.SANDBOX_CAPACITY,
    ),
    (
        "scheduled but not started past the schedule budget",
        pod(scheduled=True, waiting="ContainerCreating"),
        "schedule",
        301,
        [],
        FailureCode.SANDBOX_CAPACITY,
    ),
    (
        "ErrImagePull while Pending, long before the budget",
        pod(waiting="ErrImagePull"),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_IMAGE_INVALID,
    ),
    (
        "ImagePullBackOff while Pending",
        pod(waiting="ImagePullBackOff"),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_IMAGE_INVALID,
    ),
    (
        "InvalidImageName while Pending",
        pod(waiting="InvalidImageName"),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_IMAGE_INVALID,
    ),
    (
        "an image pull error in an init container",
        pod(init_waiting="ErrImagePull"),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_IMAGE_INVALID,
    ),
    (
        "an image pull error only in the events, while Pending",
        pod(scheduled=True),
        "schedule",
        3,
        [PULL_EVENT],
        FailureCode.SANDBOX_IMAGE_INVALID,
    ),
    (
        "CreateContainerConfigError",
        pod(waiting="CreateContainerConfigError"),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_START_FAILED,
    ),
    (
        "CreateContainerError",
        pod(waiting="CreateContainerError"),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_START_FAILED,
    ),
    (
        "CrashLoopBackOff",
        pod("Running", waiting="CrashLoopBackOff"),
        "ready",
        3,
        [],
        FailureCode.SANDBOX_START_FAILED,
    ),
    (
        "the container exited (restartPolicy Never: Failed)",
        pod("Failed", terminated=127),
        "schedule",
        3,
        [],
        FailureCode.SANDBOX_START_FAILED,
    ),
    (
        "running: the schedule phase is done",
        pod("Running", running=True),
        "schedule",
        3,
        [],
        "started",
    ),
    (
        "running, not Ready, within the ready budget",
        pod("Running", running=True),
        "ready",
        60,
        [],
        None,
    ),
    (
        "running but never Ready past the ready budget",
        pod("Running", running=True),
        "ready",
        121,
        [],
        FailureCode.SANDBOX_START_FAILED,
    ),
    ("Ready", pod("Running", ready=True), "ready", 5, [], "ready"),
    (
        "Ready straight from the schedule phase",
        pod("Running", ready=True),
        "schedule",
        5,
        [],
        "ready",
    ),
    ("an uninspectable pod", None, "schedule", 1, [], FailureCode.SANDBOX_START_FAILED),
    (
        "just created, no status yet: wait",
        V1Pod.model_validate({"metadata": {"name": "rf-pod", "uid": UID}}),
        "schedule",
        1,
        [],
        None,
    ),
    (
        "a seed phase that ran and stalled",
        pod("Running", ready=True),
        "seed",
        61,
        [],
        FailureCode.SANDBOX_SETUP_TIMEOUT,
    ),
    ("a seed phase within its budget", pod("Running", ready=True), "seed", 30, [], "ready"),
    (
        "a UID change: another pod under the name",
        pod("Running", ready=True, uid="uid-2"),
        "ready",
        5,
        [],
        FailureCode.SANDBOX_LOST,
    ),
    (
        "evicted while starting (same UID)",
        pod("Failed", reason="Evicted"),
        "ready",
        5,
        [],
        FailureCode.SANDBOX_LOST,
    ),
    (
        "deleted while starting",
        pod("Running", running=True, deleting=True),
        "ready",
        5,
        [],
        FailureCode.SANDBOX_LOST,
    ),
]


@pytest.mark.parametrize(
    ("case", "the_pod", "phase", "elapsed", "events", "expected"),
    ROWS,
    ids=[row[0] for row in ROWS],
)
def test_start_failures_are_classified_as_spec_7_1_says(
    case: str,
    the_pod: V1Pod | None,
    phase: Phase,
    elapsed: float,
    events: list[CoreV1Event],
    expected: object,
) -> None:
    verdict: Verdict = classify_start(
        the_pod,
        phase=phase,
        elapsed_s=elapsed,
        budgets=BUDGETS,
        uid=UID,
        events=events,
        name="rf-pod",
    )
    if isinstance(expected, FailureCode):
        assert isinstance(verdict, StartFailure), (case, verdict)
        assert verdict.code is expected, (case, verdict)
    else:
        assert verdict == expected, (case, verdict)


@pytest.mark.parametrize(
    ("phase", "elapsed", "budget"),
    [("schedule", 301.0, "300s"), ("ready", 121.0, "120s"), ("seed", 61.0, "60s")],
)
def test_a_start_failure_names_its_phase_elapsed_time_and_budget(
    phase: Phase, elapsed: float, budget: str
) -> None:
    the_pod = pod(unschedulable="0/3") if phase == "schedule" else pod("Running", running=True)
    if phase == "seed":
        the_pod = pod("Running", ready=True)
    verdict = classify_start(
        the_pod, phase=phase, elapsed_s=elapsed, budgets=BUDGETS, name="rf-pod"
    )
    assert isinstance(verdict, StartFailure)
    assert f"{phase} phase" in verdict.message
    assert f"{elapsed:.1f}s" in verdict.message and f"{budget} budget" in verdict.message
    assert "rf-pod" in verdict.message


def test_a_uid_unknown_yet_is_not_a_replacement() -> None:
    assert (
        classify_start(
            pod("Running", ready=True, uid="whatever"), phase="ready", elapsed_s=1, budgets=BUDGETS
        )
        == "ready"
    )


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (409, 'pods "rf-x" already exists', FailureCode.SANDBOX_START_FAILED),
        (422, "spec.containers[0].image: Required value", FailureCode.SANDBOX_START_FAILED),
        (403, 'violates PodSecurity "restricted:latest"', FailureCode.SANDBOX_START_FAILED),
        (403, "exceeded quota: sandboxes, requested: pods=1", FailureCode.SANDBOX_CAPACITY),
    ],
)
def test_a_refused_create_is_classified(status: int, body: str, code: FailureCode) -> None:
    failure = classify_create_error(status, "Refused", body)
    assert failure.code is code and "create phase" in failure.message
