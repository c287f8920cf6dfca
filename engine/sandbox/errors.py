"""Errors of the sandbox seam (SPEC §7.1).

Each error that maps to one run failure code carries it (`failure_code`, a `FailureCode` row of
SPEC §6.6); `code` is the same name in snake_case for the CLI's `--json` contract.
Errors without a `failure_code` are classified by the caller, who knows what the copy was for
(a bank that does not extract parks the run, a restore that fails on the way is transient, §7.4).

    RunfleetError
    ├── UnknownSandboxDriver            a driver name the registry does not know (configuration)
    └── SandboxError                    a sandbox could not do what was asked
        ├── SandboxStartFailed          invalid spec, or the sandbox never came up
        ├── SandboxAccessDenied         the cluster refused the runner itself (RBAC, namespace)
        ├── SandboxSetupTimeout         a setup phase ran and stalled past its budget
        ├── SandboxCapacity             no room to start it before the deadline
        ├── SandboxImageInvalid         the image cannot be pulled or run
        ├── SandboxLost                 the sandbox went away under a running execution
        ├── SandboxRecordCorrupt        a local sandbox record is not what we wrote
        ├── SandboxExecFailed           a command could not be run, or its stream broke
        └── SandboxCopyFailed           a tar stream in or out failed on the way
            ├── SandboxCopyTooLarge     a tar out passed the bound its caller set
            └── SandboxArchiveInvalid   the archive itself does not extract
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.failures import FailureCode
from store.errors import RunfleetError

__all__ = [
    "SandboxAccessDenied",
    "SandboxArchiveInvalid",
    "SandboxCapacity",
    "SandboxCopyFailed",
    "SandboxCopyTooLarge",
    "SandboxError",
    "SandboxExecFailed",
    "SandboxImageInvalid",
    "SandboxLost",
    "SandboxRecordCorrupt",
    "SandboxSetupTimeout",
    "SandboxStartFailed",
    "UnknownSandboxDriver",
]


class UnknownSandboxDriver(RunfleetError, code="unknown_sandbox_driver"):
    """A configuration error, raised before any sandbox exists: deliberately not a
    `SandboxError`, which an execution turns into a node failure."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        names = ", ".join(known)
        super().__init__(
            f"no sandbox driver {name!r} (known: {names})",
            remedy=f"set RUNFLEET_SANDBOX (or the workflow's sandbox.driver) to one of: {names}",
        )
        self.name = name
        self.known = known


class SandboxError(RunfleetError, code="sandbox_error"):
    """A sandbox could not do what was asked.

    A subclass that maps to one run failure code names it in its header,
    `class SandboxLost(SandboxError, failure_code=FailureCode.SANDBOX_LOST)`, and its `code` is
    that name in snake_case: one statement, so the two can never disagree.
    """

    failure_code: ClassVar[FailureCode | None] = None
    """The run failure code (SPEC §6.6) this error maps to, when it maps to exactly one."""

    def __init_subclass__(
        cls, *, failure_code: FailureCode | None = None, code: str | None = None, **kwargs: Any
    ) -> None:
        if failure_code is not None:
            cls.failure_code = failure_code
            code = code or failure_code.value.lower()
        super().__init_subclass__(code=code, **kwargs)


class SandboxStartFailed(SandboxError, failure_code=FailureCode.SANDBOX_START_FAILED):
    """Deterministic: retrying the same spec will fail the same way."""


class SandboxAccessDenied(SandboxError, code="sandbox_access_denied"):
    """The API server refused the runner, not the pod: its credentials (401), its RBAC (403
    "cannot create resource"), or a sandbox namespace that does not exist (404). That is how
    the cluster was set up, which an operator fixes, not the run's spec: no failure code of its
    own, so an execution reads `INTERNAL_ERROR` (transient, §6.6) and the run waits on the nak
    ladder, then in the DLQ, to be replayed once the Role or namespace is right. Read as
    `SANDBOX_START_FAILED` it would fail every run for good."""

    remedy = (
        "check that RUNFLEET_SANDBOX_NAMESPACE exists and that the runner's ServiceAccount may "
        "create, get, list, watch and delete pods and create pods/exec there (docs/kubernetes.md,"
        " RBAC); then replay the parked runs (`runfleet dlq replay --all`)"
    )


class SandboxSetupTimeout(SandboxError, failure_code=FailureCode.SANDBOX_SETUP_TIMEOUT):
    """A setup phase ran and stalled past its budget."""


class SandboxCapacity(SandboxError, failure_code=FailureCode.SANDBOX_CAPACITY):
    """No room to start the sandbox before the deadline."""


class SandboxImageInvalid(SandboxError, failure_code=FailureCode.SANDBOX_IMAGE_INVALID):
    """The image cannot be pulled or run."""


class SandboxLost(SandboxError, failure_code=FailureCode.SANDBOX_LOST):
    """The sandbox was stopped (by this execution, or by another execution's claim) or died
    while this execution still needed it. `reason` is the one word of `sandbox_lost {reason,
    message}` (SPEC §7.2): the continuity watch's (`deleted`, `evicted`, `replaced`, ...)."""

    def __init__(self, message: str, *, reason: str = "gone") -> None:
        super().__init__(message)
        self.reason = reason


class SandboxRecordCorrupt(SandboxError, code="sandbox_record_corrupt"):
    """A local driver record that does not parse; it is reported, never guessed at."""

    remedy = "stop the processes by hand, then delete the record under RUNFLEET_DATA/sandboxes/"


class SandboxExecFailed(SandboxError, code="sandbox_exec_failed"):
    """The API server refused an exec, or its stream broke before the command's status came.
    No failure code of its own (an execution reads `INTERNAL_ERROR`, transient): the command may
    still run in the pod, so the node is not retried in place, and whether the pod is lost is
    the continuity watch's call (§7.2), never an exec stream's."""


class SandboxCopyFailed(SandboxError, code="sandbox_copy_failed"):
    """A tar stream into or out of the sandbox failed on the way."""


class SandboxArchiveInvalid(SandboxCopyFailed, code="sandbox_archive_invalid"):
    """The archive itself does not extract."""


class SandboxCopyTooLarge(SandboxCopyFailed, code="sandbox_copy_too_large"):
    """A copy out whose tar stream passed the `max_bytes` its caller set. The stream is cut as it
    passes the bound and the partial host file removed, so a huge (or hostile) directory costs
    the host at most the bound in disk, never the whole tar. No failure code of its own: the
    same directory passes the bound again, so the caller decides, not a retry (the bank records
    the scratch `unbankable`, as one over its compressed cap, §7.3). `received` is how much of
    the stream had arrived when it was cut: at most the bound plus the one chunk that passed it."""

    def __init__(self, src: str, max_bytes: int, received: int) -> None:
        super().__init__(
            f"the tar of {src} passed its bound of {max_bytes} bytes uncompressed "
            f"(cut after {received} bytes)"
        )
        self.src = src
        self.max_bytes = max_bytes
        self.received = received
