"""The sandbox seam (SPEC §7): the `SandboxDriver` / `Sandbox` protocols, their errors, and the
`local` driver. The `kubernetes` driver lives beside it and implements the same protocols."""

from engine.sandbox.errors import (
    SandboxArchiveInvalid,
    SandboxCapacity,
    SandboxCopyFailed,
    SandboxError,
    SandboxImageInvalid,
    SandboxLost,
    SandboxRecordCorrupt,
    SandboxSetupTimeout,
    SandboxStartFailed,
)
from engine.sandbox.local import LocalSandbox, LocalSandboxDriver
from engine.sandbox.protocols import (
    OUTPUT_CHUNK_BYTES,
    OUTPUT_TAIL_BYTES,
    ExecResult,
    OutputCallback,
    Sandbox,
    SandboxCapabilities,
    SandboxDriver,
    SandboxRef,
    SandboxSpec,
)

__all__ = [
    "OUTPUT_CHUNK_BYTES",
    "OUTPUT_TAIL_BYTES",
    "ExecResult",
    "LocalSandbox",
    "LocalSandboxDriver",
    "OutputCallback",
    "Sandbox",
    "SandboxArchiveInvalid",
    "SandboxCapabilities",
    "SandboxCapacity",
    "SandboxCopyFailed",
    "SandboxDriver",
    "SandboxError",
    "SandboxImageInvalid",
    "SandboxLost",
    "SandboxRecordCorrupt",
    "SandboxRef",
    "SandboxSetupTimeout",
    "SandboxSpec",
    "SandboxStartFailed",
]
