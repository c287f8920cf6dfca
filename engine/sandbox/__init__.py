"""The sandbox seam (SPEC §7): the `SandboxDriver` / `Sandbox` protocols (`protocols.py`), their
errors (`errors.py`), the registry that turns a driver name into a driver (`registry.py`), and
one sub-package per driver: `local/` today; `kubernetes/` implements the same protocols and
plugs into the registry."""

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
    UnknownSandboxDriver,
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
from engine.sandbox.registry import DriverContext, DriverFactory, driver_names, open_driver

__all__ = [
    "OUTPUT_CHUNK_BYTES",
    "OUTPUT_TAIL_BYTES",
    "DriverContext",
    "DriverFactory",
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
    "UnknownSandboxDriver",
    "driver_names",
    "open_driver",
]
