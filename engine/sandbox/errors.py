"""Errors of the sandbox seam (SPEC §7.1).

Each error that maps to one run failure code carries it (`failure_code`, a `FailureCode` row of
SPEC §6.6); `code` is the same name in snake_case for the CLI's `--json` contract.
Errors without a `failure_code` are classified by the caller, who knows what the copy was for
(a bank that does not extract parks the run, a restore that fails on the way is transient, §7.4).

    RunfleetError
    └── SandboxError                    a sandbox could not do what was asked
        ├── SandboxStartFailed          invalid spec, or the sandbox never came up
        ├── SandboxSetupTimeout         a setup phase ran and stalled past its budget
        ├── SandboxCapacity             no room to start it before the deadline
        ├── SandboxImageInvalid         the image cannot be pulled or run
        ├── SandboxLost                 the sandbox went away under a running execution
        ├── SandboxRecordCorrupt        a local sandbox record is not what we wrote
        └── SandboxCopyFailed           a tar stream in or out failed on the way
            └── SandboxArchiveInvalid   the archive itself does not extract
"""

from __future__ import annotations

from typing import ClassVar

from engine.failures import FailureCode
from store.errors import RunfleetError

__all__ = [
    "SandboxArchiveInvalid",
    "SandboxCapacity",
    "SandboxCopyFailed",
    "SandboxError",
    "SandboxImageInvalid",
    "SandboxLost",
    "SandboxRecordCorrupt",
    "SandboxSetupTimeout",
    "SandboxStartFailed",
]


class SandboxError(RunfleetError):
    code = "sandbox_error"
    failure_code: ClassVar[FailureCode | None] = None
    """The run failure code (SPEC §6.6) this error maps to, when it maps to exactly one."""


class SandboxStartFailed(SandboxError):
    """Deterministic: retrying the same spec will fail the same way."""

    code = "sandbox_start_failed"
    failure_code = FailureCode.SANDBOX_START_FAILED


class SandboxSetupTimeout(SandboxError):
    code = "sandbox_setup_timeout"
    failure_code = FailureCode.SANDBOX_SETUP_TIMEOUT


class SandboxCapacity(SandboxError):
    code = "sandbox_capacity"
    failure_code = FailureCode.SANDBOX_CAPACITY


class SandboxImageInvalid(SandboxError):
    code = "sandbox_image_invalid"
    failure_code = FailureCode.SANDBOX_IMAGE_INVALID


class SandboxLost(SandboxError):
    """The sandbox was stopped (by this execution, or by another execution's claim) or died
    while this execution still needed it."""

    code = "sandbox_lost"
    failure_code = FailureCode.SANDBOX_LOST


class SandboxRecordCorrupt(SandboxError):
    """A local driver record that does not parse; it is reported, never guessed at."""

    code = "sandbox_record_corrupt"
    remedy = "stop the processes by hand, then delete the record under RUNFLEET_DATA/sandboxes/"


class SandboxCopyFailed(SandboxError):
    code = "sandbox_copy_failed"


class SandboxArchiveInvalid(SandboxCopyFailed):
    code = "sandbox_archive_invalid"
