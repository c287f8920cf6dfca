"""The `local` driver: sandboxes as process groups on this host (SPEC §7.1).

`start` makes the work dirs, writes an empty record under the run's lock (refusing a name that
exists) and starts the sandbox's watchdog; `stop_others` ends every other execution's recorded
groups of the run, from any process on the host (§5.3).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

from engine.sandbox.errors import SandboxStartFailed
from engine.sandbox.local.groups import DEFAULT_KILL_GRACE_S, terminate_groups
from engine.sandbox.local.records import (
    SandboxRecord,
    check_name,
    read_record,
    run_lock,
    sandbox_name,
    write_record,
)
from engine.sandbox.local.sandbox import LocalSandbox
from engine.sandbox.local.watchdog import start_watchdog
from engine.sandbox.protocols import SandboxCapabilities, SandboxRef, SandboxSpec

__all__ = ["LocalSandboxDriver"]

_CAPABILITIES = SandboxCapabilities(
    process_isolated=False, host_backed_scratch=True, supports_dir_copy=True, attachments="host"
)


class LocalSandboxDriver:
    """Sandboxes as process groups on this host, recorded under `<data_dir>/sandboxes/`."""

    def __init__(self, data_dir: Path, *, kill_grace_s: float = DEFAULT_KILL_GRACE_S) -> None:
        self._root = Path(data_dir).absolute() / "sandboxes"
        self._root_str = str(self._root)
        self._grace = kill_grace_s

    @property
    def capabilities(self) -> SandboxCapabilities:
        return _CAPABILITIES

    def record_path(self, run_id: str, token: str) -> Path:
        return self._root / run_id / f"{token}.json"

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        check_name(spec.run_id, "run id")
        check_name(spec.lease_token, "lease token")
        spec = replace(
            spec,
            workspace_dir=spec.workspace_dir.absolute(),
            scratch_dir=spec.scratch_dir.absolute(),
            attachments_dir=spec.attachments_dir and spec.attachments_dir.absolute(),
        )
        try:
            spec.workspace_dir.mkdir(parents=True, exist_ok=True)
            spec.scratch_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SandboxStartFailed(f"cannot create the sandbox directories: {e}") from e
        path = self.record_path(spec.run_id, spec.lease_token)
        async with run_lock(path.parent):
            if path.exists():
                raise SandboxStartFailed(f"sandbox {path.stem} of run {spec.run_id} exists")
            write_record(path, SandboxRecord(spec.run_id, spec.lease_token))
        try:
            watchdog = await start_watchdog(path, self._grace, spec.setup_timeout_s)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return LocalSandbox(spec, path, watchdog, self._grace)

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        # Asked at every claim, and almost always "none": one `stat` of a local directory on a
        # string path, no `Path` built (a measurable share of a claim, issue 19's profile).
        if not os.path.isdir(os.path.join(self._root_str, run_id)):  # noqa: ASYNC240
            return []
        run_dir = self._root / run_id
        async with run_lock(run_dir):
            paths = [p for p in sorted(run_dir.glob("*.json")) if p.stem != keep_token]
            records = [(p, r) for p in paths if (r := read_record(p)) is not None]
            groups = [g for _, r in records for g in r.groups]
            await asyncio.to_thread(terminate_groups, groups, self._grace)
            for path, _ in records:
                path.unlink(missing_ok=True)
        return [r.name for _, r in records]

    async def list_sandboxes(self) -> list[SandboxRef]:
        if not self._root.is_dir():
            return []
        paths = sorted(self._root.glob("*/*.json"))
        return [
            SandboxRef(p.parent.name, p.stem, sandbox_name(p.parent.name, p.stem)) for p in paths
        ]
