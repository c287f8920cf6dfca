"""`KubernetesSandbox`: a running sandbox pod (SPEC §7.1, §7.2).

Every command runs over the exec subresource (`exec.py`) as `/bin/sh -c`, in the workspace with
`RUNFLEET_WORKSPACE` / `RUNFLEET_SCRATCH_DIR` set (the pod's env has them too; saying them in
the script keeps a command's view the same wherever the exec lands). The continuity watch runs
from the sandbox's creation to its `stop`; an exec races it, so a lost pod raises `SandboxLost`
at once with the watch's reason and the exec in flight is abandoned (its websocket closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shlex
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kubernetes.aio.client import CoreV1Api

from engine.archive import ArchiveError, make_archive
from engine.sandbox.errors import SandboxCopyFailed, SandboxError, SandboxLost
from engine.sandbox.kubernetes import abandon
from engine.sandbox.kubernetes import copy as pod_copy
from engine.sandbox.kubernetes import exec as pod_exec
from engine.sandbox.kubernetes.pod import CONTAINER, SCRATCH, WORKSPACE
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.kubernetes.watch import PodWatch
from engine.sandbox.protocols import ExecResult, OutputCallback

if TYPE_CHECKING:
    from collections.abc import Coroutine

__all__ = ["KubernetesSandbox", "PodOwner", "pack_dir", "sandbox_path"]


class PodOwner(Protocol):
    """What a sandbox needs of the driver that started it (the driver imports this module,
    so the arrow points one way)."""

    @property
    def settings(self) -> KubernetesSettings: ...

    async def delete_pod(self, api: CoreV1Api, name: str, uid: str | None) -> bool: ...


T = TypeVar("T")
LOSS_SETTLE_S = 2.0
"""How long a killed command waits for the watch to say whether its pod was lost."""
_KILLED = frozenset({137, 143, -9, -15})
"""SIGKILL / SIGTERM, as the exec status (128 + n) or as a signal."""
END_GRACE_S = 2.0
"""A timed-out command's SIGTERM → SIGKILL grace inside the pod (the local driver's default)."""
END_EXEC_SLACK_S = 10.0
"""How long the ending exec may take beyond its grace before it is itself abandoned."""
log = logging.getLogger(__name__)


def sandbox_path(path: str | Path) -> str:
    """A path inside the pod: relative means relative to the workspace."""
    posix = PurePosixPath(str(path))
    return str(posix if posix.is_absolute() else PurePosixPath(WORKSPACE) / posix)


@contextlib.asynccontextmanager
async def pack_dir(directory: Path) -> AsyncIterator[Path]:
    """`directory` as a gzip tar in a host temp file (members relative to it, modes kept: the
    attachments stay read-only), removed after. Made by the one archive module
    (`engine.archive`, STYLE.md), at gzip level 1: a seed is copied once, over the exec stream."""
    with tempfile.TemporaryDirectory(prefix="runfleet-seed-") as tmp:
        tar_path = Path(tmp) / "seed.tgz"
        try:
            await asyncio.to_thread(make_archive, directory, tar_path, level=1)
        except (OSError, ArchiveError) as exc:
            raise SandboxCopyFailed(f"cannot pack {directory}: {exc}") from exc
        yield tar_path


class KubernetesSandbox:
    def __init__(
        self,
        driver: PodOwner,
        api: CoreV1Api,
        name: str,
        uid: str,
        watch: PodWatch,
    ) -> None:
        self._driver = driver
        self._api = api
        self._name = name
        self.uid = uid
        self.watch = watch
        self._namespace = driver.settings.namespace
        self._watch_task: asyncio.Task[None] = asyncio.create_task(
            watch.run(), name=f"sandbox-watch:{name}"
        )
        self._stopped = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def lost(self) -> asyncio.Event:
        """Set when the continuity watch judged the pod gone (§7.2)."""
        return self.watch.lost

    def _loss(self) -> SandboxLost:
        if self._stopped:
            return SandboxLost(f"sandbox pod {self._name} was stopped", reason="stopped")
        reason = self.watch.reason or "gone"
        return SandboxLost(f"sandbox pod {self._name} lost: {self.watch.message}", reason=reason)

    async def _guarded(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`, abandoned the moment the watch reports the pod lost."""
        task = asyncio.ensure_future(work)
        if self._stopped or self.lost.is_set():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise self._loss()
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task.cancelled() or (self.lost.is_set() and not _finished_ok(task)):
            raise self._loss()
        return task.result()

    async def exec(
        self, command: str, *, timeout_s: float, on_output: OutputCallback | None = None
    ) -> ExecResult:
        exec_id = secrets.token_hex(8)
        script = (
            abandon.pid_prelude(exec_id)
            + f"export RUNFLEET_WORKSPACE={WORKSPACE} RUNFLEET_SCRATCH_DIR={SCRATCH}\n"
            f"cd {WORKSPACE} || exit 1\n{command}"
        )
        result = await self._guarded(
            pod_exec.exec_in_pod(
                self._api,
                self._namespace,
                self._name,
                CONTAINER,
                ["/bin/sh", "-c", script],
                timeout=timeout_s,
                on_output=on_output,
            )
        )
        if result.timed_out:
            await self._end_abandoned(exec_id)
        elif result.exit_code in _KILLED:
            # Killed: the kubelet ends a deleted pod's processes, and the exec's status may
            # arrive a moment before the watch's event. A node is not a tool failure when its
            # pod was taken: wait briefly for the watch's word.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lost.wait(), LOSS_SETTLE_S)
            if self.lost.is_set():
                raise self._loss()
        return result

    async def _end_abandoned(self, exec_id: str) -> None:
        """The timed-out command and all it started, ended inside the pod (`abandon`). Best
        effort: a pod that cannot be reached is the watch's news, not this result's."""
        try:
            await pod_exec.exec_in_pod(
                self._api,
                self._namespace,
                self._name,
                CONTAINER,
                ["/bin/sh", "-c", abandon.end_script(exec_id, END_GRACE_S)],
                timeout=END_GRACE_S + END_EXEC_SLACK_S,
            )
        except SandboxError as exc:
            log.warning("%s: a timed-out command could not be ended: %s", self._name, exc)

    async def copy_out(self, src: Path, dest_tar: Path, *, max_bytes: int | None = None) -> None:
        await self._guarded(
            pod_copy.copy_out(
                self._api,
                self._namespace,
                self._name,
                CONTAINER,
                sandbox_path(src),
                dest_tar,
                gzip_level=None,
                max_bytes=max_bytes,
            )
        )

    async def copy_in(self, tar: Path, dest_dir: Path) -> None:
        """A copy in (the scratch's restore) is bounded as a seed is: by the seed budget
        (`RUNFLEET_SANDBOX_SEED_BUDGET`); a stalled `tar -x` is `SandboxCopyFailed`."""
        await self._guarded(
            pod_copy.copy_in(
                self._api,
                self._namespace,
                self._name,
                CONTAINER,
                tar,
                sandbox_path(dest_dir),
                timeout_s=self._driver.settings.budgets.seed_s,
            )
        )

    async def stop(self) -> None:
        """Stop the watch first (our own delete is not a loss), then delete the pod with the
        grace and confirm it gone. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.watch.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch_task
        try:
            await self._driver.delete_pod(self._api, self._name, self.uid or None)
        except SandboxError as exc:  # left for the sweeper, which lists by label (§5.9)
            log.warning("%s; the sweeper reaps it", exc)

    def __repr__(self) -> str:
        return f"KubernetesSandbox({shlex.quote(self._name)}, uid={self.uid})"


def _finished_ok(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None
