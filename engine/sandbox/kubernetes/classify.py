"""Start-failure classification (SPEC §7.1): pure functions from what the API server said about a
pod to a verdict. No I/O: the driver reads, this decides, a table test covers every row.

    Pending, unscheduled or not started, past the schedule budget   SANDBOX_CAPACITY
    ErrImagePull / ImagePullBackOff / InvalidImageName (even while
      Pending; also read from the pod's events)                      SANDBOX_IMAGE_INVALID
    CreateContainerConfigError, CreateContainerError, CrashLoopBackOff,
      a container that ended, Running but never Ready past the ready
      budget, an uninspectable pod                                   SANDBOX_START_FAILED
    a seed phase that ran and stalled past the seed budget           SANDBOX_SETUP_TIMEOUT
    deleted, evicted or replaced (another UID) while starting        SANDBOX_LOST

Every failure's message names the phase, the elapsed time and the phase's budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from kubernetes.aio.client import CoreV1Event, V1ContainerStatus, V1Pod, V1PodStatus

from engine.failures import FailureCode
from engine.sandbox.protocols import SetupBudgets

__all__ = [
    "IMAGE_REASONS",
    "LOSS_REASONS",
    "START_REASONS",
    "Phase",
    "StartFailure",
    "Verdict",
    "classify_create_error",
    "classify_start",
    "refused_access",
]

Phase = Literal["schedule", "ready", "seed"]
"""created → scheduled and started; started → Ready; workspace, scratch, attachments copied in."""

IMAGE_REASONS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
START_REASONS = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
        "RunContainerError",
        "StartError",
        "ContainerCannotRun",
    }
)
LOSS_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "NodeShutdown"})
"""`status.reason` of a pod the cluster took away (the UID is kept: §7.2)."""


@dataclass(frozen=True, slots=True)
class StartFailure:
    code: FailureCode
    message: str


Verdict = StartFailure | Literal["started", "ready"] | None
"""A failure; `"started"` (scheduled, containers running: the ready phase begins); `"ready"`;
`None` (still within the phase, keep waiting)."""


def _budget(phase: Phase, budgets: SetupBudgets) -> float:
    return {"schedule": budgets.schedule_s, "ready": budgets.ready_s, "seed": budgets.seed_s}[phase]


def classify_start(
    pod: V1Pod | None,
    *,
    phase: Phase,
    elapsed_s: float,
    budgets: SetupBudgets,
    uid: str | None = None,
    events: Sequence[CoreV1Event] = (),
    name: str = "",
) -> Verdict:
    """The verdict on `pod` (`None`: it could not be read) `elapsed_s` into `phase`; `uid` is
    the UID the create answered with (`None`: not known yet)."""
    budget = _budget(phase, budgets)

    def fail(code: FailureCode, detail: str) -> StartFailure:
        return StartFailure(
            code,
            f"sandbox pod {name or '?'}: {phase} phase: {detail} "
            f"(after {elapsed_s:.1f}s of a {budget:g}s budget)",
        )

    if pod is None or pod.metadata is None:
        return fail(FailureCode.SANDBOX_START_FAILED, "the pod could not be inspected")
    meta, status = pod.metadata, pod.status or V1PodStatus()  # no status yet: just created
    if uid is not None and meta.uid is not None and meta.uid != uid:
        return fail(FailureCode.SANDBOX_LOST, f"the pod was replaced (UID {meta.uid}, not {uid})")
    if meta.deletion_timestamp is not None:
        return fail(FailureCode.SANDBOX_LOST, "the pod is being deleted")
    statuses = [*(status.init_container_statuses or []), *(status.container_statuses or [])]
    for reason, message in _waiting(statuses):
        if reason in IMAGE_REASONS:
            return fail(FailureCode.SANDBOX_IMAGE_INVALID, f"{reason}: {message}")
    for reason, message in _image_events(events):
        return fail(FailureCode.SANDBOX_IMAGE_INVALID, f"{reason}: {message}")
    for reason, message in _waiting(statuses):
        if reason in START_REASONS:
            return fail(FailureCode.SANDBOX_START_FAILED, f"{reason}: {message}")
    if status.phase in ("Failed", "Succeeded"):
        if status.reason in LOSS_REASONS:
            return fail(FailureCode.SANDBOX_LOST, f"{status.reason}: {status.message or ''}")
        return fail(
            FailureCode.SANDBOX_START_FAILED,
            f"the pod is {status.phase}{_ended(statuses)}",
        )
    for cs in status.container_statuses or []:
        if cs.state is not None and cs.state.terminated is not None:
            return fail(FailureCode.SANDBOX_START_FAILED, f"the container ended{_ended([cs])}")
    if phase == "seed":
        if elapsed_s > budget:
            return fail(FailureCode.SANDBOX_SETUP_TIMEOUT, "the copy in did not finish")
        return "ready"
    if _ready(pod):
        return "ready"
    started = (
        status.phase == "Running"
        and bool(status.container_statuses)
        and all(
            cs.state is not None and cs.state.running is not None
            for cs in status.container_statuses or []
        )
    )
    if phase == "schedule":
        if started:
            return "started"
        if elapsed_s > budget:
            return fail(FailureCode.SANDBOX_CAPACITY, _not_started(pod))
        return None
    if elapsed_s > budget:
        if not started:
            return fail(FailureCode.SANDBOX_START_FAILED, "the containers stopped running")
        return fail(FailureCode.SANDBOX_START_FAILED, "Running but never Ready")
    return None


def _waiting(statuses: Iterable[V1ContainerStatus]) -> Iterable[tuple[str, str]]:
    for cs in statuses:
        waiting = cs.state.waiting if cs.state is not None else None
        if waiting is not None and waiting.reason:
            yield waiting.reason, waiting.message or ""


def _image_events(events: Sequence[CoreV1Event]) -> Iterable[tuple[str, str]]:
    """An image error the kubelet reported as an event before the status said so."""
    for event in events:
        message = event.message or ""
        if event.reason == "InspectFailed" or (
            event.reason in ("Failed", "ErrImagePull") and "pull image" in message
        ):
            yield event.reason or "Failed", message


def _ready(pod: V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return (
        pod.status is not None
        and pod.status.phase == "Running"
        and any(c.type == "Ready" and c.status == "True" for c in conditions)
    )


def _not_started(pod: V1Pod) -> str:
    conditions = (pod.status.conditions if pod.status else None) or []
    for c in conditions:
        if c.type == "PodScheduled" and c.status != "True":
            return f"not scheduled: {c.reason or ''} {c.message or ''}".rstrip()
    if not any(c.type == "PodScheduled" and c.status == "True" for c in conditions):
        return "not scheduled"
    return "scheduled, containers not started"


def _ended(statuses: Iterable[V1ContainerStatus]) -> str:
    for cs in statuses:
        term = cs.state.terminated if cs.state is not None else None
        if term is not None:
            return f" ({cs.name} exited {term.exit_code}: {term.reason or ''} {term.message or ''})"
    return ""


def refused_access(status: int, body: str) -> bool:
    """A refused create that says nothing about the pod: the runner's credentials (401), its
    RBAC (403 "cannot create resource", where Pod Security's 403 says "violates"), or a
    namespace that is not there (404). `SandboxAccessDenied`, never a verdict on the run."""
    return status in (401, 404) or (status == 403 and "cannot create resource" in body)


def classify_create_error(status: int, reason: str, body: str) -> StartFailure:
    """The verdict on a create the API server refused (phase `create`): quota → capacity;
    a pod of this name exists (an execution never gets a second pod) or a manifest refused by
    validation or admission (Pod Security) → start failed."""
    detail = f"create refused: {status} {reason}: {body[:300]}"
    if status == 403 and "exceeded quota" in body:
        return StartFailure(FailureCode.SANDBOX_CAPACITY, f"sandbox pod: create phase: {detail}")
    return StartFailure(FailureCode.SANDBOX_START_FAILED, f"sandbox pod: create phase: {detail}")
