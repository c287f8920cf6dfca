"""The sandbox seam: `SandboxDriver` starts `Sandbox`es, one per execution (SPEC §7.1).

A sandbox is named by run id + lease token, so a later execution of the same run can find and
stop an earlier one's (`stop_others`, which every claim calls before its first node, §5.3).
Commands run with cwd = the execution's workspace and `RUNFLEET_SCRATCH_DIR` in their env.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "OUTPUT_CHUNK_BYTES",
    "OUTPUT_TAIL_BYTES",
    "ExecResult",
    "OutputCallback",
    "Sandbox",
    "SandboxCapabilities",
    "SandboxDriver",
    "SandboxRef",
    "SandboxSpec",
    "SeedDir",
    "SetupBudgets",
]

OUTPUT_CHUNK_BYTES = 64 * 1024
"""The largest chunk handed to an `on_output` callback."""

OUTPUT_TAIL_BYTES = 64 * 1024
"""How much of each stream an `ExecResult` keeps (the end of it)."""

OutputCallback = Callable[[str, bytes], Awaitable[None]]
"""`on_output(stream_name, chunk)`, stream_name is "stdout" or "stderr"."""


@dataclass(frozen=True, slots=True)
class SandboxCapabilities:
    process_isolated: bool
    """Other processes of the sandbox can be stopped before a scratch is read (§7.3); when
    False a bank is recorded `unquiesced`."""
    host_backed_scratch: bool
    """The scratch is a host directory that survives the sandbox (no bank needed, §7.2b)."""
    supports_dir_copy: bool
    """`copy_in` / `copy_out` work."""
    attachments: Literal["host", "copy", "none"] = "none"
    """How the run's attachments reach its commands (SPEC §8): `host`, the sandbox opens the
    host directory `SandboxSpec.attachments_dir` as it is (read-only files); `copy`, they are
    copied into `/run/runfleet/attachments/` during the seed phase (`seed_dirs`); `none`, the
    driver can do neither, and a run that holds attachments is refused
    `ATTACHMENTS_UNDELIVERABLE` at sandbox start."""


@dataclass(frozen=True, slots=True)
class SetupBudgets:
    """One budget per setup phase of a remote sandbox (SPEC §7.1, v2.2), in seconds: a phase
    that overruns its own budget fails with that phase, its elapsed time and this budget named."""

    schedule_s: float = 300.0
    """Created → scheduled and its containers started (`RUNFLEET_SANDBOX_SCHEDULE_BUDGET`)."""
    ready_s: float = 120.0
    """Started → Ready (`RUNFLEET_SANDBOX_READY_BUDGET`)."""
    seed_s: float = 120.0
    """Workspace, scratch and attachments copied in (`RUNFLEET_SANDBOX_SEED_BUDGET`)."""


@dataclass(frozen=True, slots=True)
class SeedDir:
    """A host directory copied into the sandbox before its first command (the seed phase)."""

    host: Path
    sandbox: str
    """Where it goes inside the sandbox; relative means relative to the workspace."""


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    run_id: str
    lease_token: str
    workspace_dir: Path
    scratch_dir: Path
    attachments_dir: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    setup_timeout_s: float = 60.0
    """The budget of each setup phase of a driver without `budgets` (the local driver's)."""
    driver: str | None = None
    """The workflow's `sandbox.driver`: wins over `RUNFLEET_SANDBOX` (SPEC §6.1); `None` = that
    setting's driver. Read by `engine.sandbox.router.DriverRouter`."""
    image: str | None = None
    """The workflow's `sandbox.options.image`; `None` = the driver's default image."""
    resources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """The workflow's `sandbox.options.resources`: `{"requests"|"limits": {"cpu"|"memory": q}}`."""
    budgets: SetupBudgets | None = None
    """Per-phase budgets; `None` = the driver's configured ones."""
    seed_dirs: tuple[SeedDir, ...] = ()
    """Copied in, in order, during the seed phase (a driver with `host_backed_scratch=False`)."""


@dataclass(frozen=True, slots=True)
class SandboxRef:
    run_id: str
    token: str
    name: str


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    """The command's exit status; negative when a signal ended it (e.g. -15 at a timeout)."""
    timed_out: bool
    stdout_tail: bytes
    stderr_tail: bytes
    duration_s: float


@runtime_checkable
class Sandbox(Protocol):
    @property
    def name(self) -> str:
        """Unique per execution: derived from run id and lease token."""
        ...

    async def exec(
        self, command: str, *, timeout_s: float, on_output: OutputCallback | None = None
    ) -> ExecResult:
        """Run a shell command to its end and return its status and the last
        `OUTPUT_TAIL_BYTES` of each stream. Output is passed to `on_output` as it arrives, in
        chunks of at most `OUTPUT_CHUNK_BYTES`. At `timeout_s` the command and everything it
        started is stopped and the result has `timed_out=True`; a non-zero exit is a result,
        not an error. Raises `SandboxLost` if the sandbox was stopped (here or by another
        execution) before or while the command ran; an exception from `on_output` stops the
        command and propagates."""
        ...

    async def copy_out(self, src: Path, dest_tar: Path, *, max_bytes: int | None = None) -> None:
        """Write the directory `src` (a path inside the sandbox; relative means relative to the
        workspace) as an uncompressed tar to the host file `dest_tar`, members relative to
        `src`. `SandboxCopyFailed` if it cannot be read or written.

        `max_bytes` bounds the tar, counted while it streams: the moment it would pass the
        bound the copy stops (a remote one cuts its stream, so the sandbox stops sending), the
        partial file is removed and `SandboxCopyTooLarge` raised, so `dest_tar` never holds
        more than `max_bytes`. A bound checked after the copy would let a huge, or hostile,
        sandbox fill the host's disk first. `None`: unbounded."""
        ...

    async def copy_in(self, tar: Path, dest_dir: Path) -> None:
        """Extract the host tar file `tar` into `dest_dir` inside the sandbox (relative means
        relative to the workspace), creating it. Members that would escape `dest_dir`, device
        files and absolute links are refused: `SandboxArchiveInvalid`; an I/O failure is
        `SandboxCopyFailed`."""
        ...

    async def stop(self) -> None:
        """Stop every process of the sandbox and release it. Idempotent; safe after the
        sandbox was stopped by another execution."""
        ...


@runtime_checkable
class SandboxDriver(Protocol):
    @property
    def capabilities(self) -> SandboxCapabilities:
        """What this driver can promise; fixed for the driver's lifetime."""
        ...

    async def start(self, spec: SandboxSpec) -> Sandbox:
        """Start the execution's sandbox, each setup phase on `spec.setup_timeout_s`.
        Raises `SandboxStartFailed`, `SandboxSetupTimeout`, `SandboxCapacity` or
        `SandboxImageInvalid`; nothing is left running after a failure."""
        ...

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        """Stop every sandbox of `run_id` whose token is not `keep_token` (earlier executions
        that may still be running, §5.3), wherever on this driver's reach they were started.
        Returns the names of those stopped; an empty list when there were none."""
        ...

    async def list_sandboxes(self) -> list[SandboxRef]:
        """Every sandbox this driver can see that has not been stopped."""
        ...
