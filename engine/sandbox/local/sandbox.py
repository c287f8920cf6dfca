"""The local sandbox: one execution's commands, each in its own recorded process group (SPEC §7.1).

A command is held at a gate (`read` on its stdin) until its group is recorded, so a group never
runs unrecorded; if the runner dies before opening the gate, the command exits without running.
Its stdin is then `/dev/null`. When it ends, times out or the sandbox stops, the whole group is
ended (SIGTERM, then SIGKILL after a grace), so a background child (`sleep 300 &`) never outlives
its node.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import tarfile
import time
from dataclasses import replace
from pathlib import Path

from engine.sandbox.errors import (
    SandboxArchiveInvalid,
    SandboxCopyFailed,
    SandboxCopyTooLarge,
    SandboxLost,
    SandboxRecordCorrupt,
)
from engine.sandbox.local.groups import (
    GroupRecord,
    process_start_time,
    signal_group,
    terminate_groups,
)
from engine.sandbox.local.records import read_record, run_lock, sandbox_name, write_record
from engine.sandbox.local.watchdog import kill_process
from engine.sandbox.protocols import (
    OUTPUT_CHUNK_BYTES,
    OUTPUT_TAIL_BYTES,
    ExecResult,
    OutputCallback,
    SandboxSpec,
)

__all__ = ["LocalSandbox"]

_HOST_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR")
# $1 is the command; it runs only after the runner wrote "go", i.e. after its group is recorded.
_GATE = 'IFS= read -r gate && [ "$gate" = go ] && exec /bin/sh -c "$1" </dev/null'


class _Tail:
    def __init__(self) -> None:
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        del self.data[:-OUTPUT_TAIL_BYTES]


async def _pump(
    name: str, reader: asyncio.StreamReader, tail: _Tail, on_output: OutputCallback | None
) -> None:
    while chunk := await reader.read(OUTPUT_CHUNK_BYTES):
        tail.add(chunk)
        if on_output is not None:
            await on_output(name, chunk)


async def _open_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=OUTPUT_CHUNK_BYTES, loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
        )
    except BaseException:
        pipe.close()
        raise
    return reader, transport


class LocalSandbox:
    """One execution's sandbox; made by `LocalSandboxDriver.start`."""

    def __init__(
        self,
        spec: SandboxSpec,
        record_path: Path,
        watchdog: asyncio.subprocess.Process,
        kill_grace_s: float,
    ) -> None:
        self.spec = spec
        self.record_path = record_path
        self._watchdog = watchdog
        self._grace = kill_grace_s
        self._live: dict[int, GroupRecord] = {}
        self._stopping = False
        self._stopped = False
        self._stop_lock = asyncio.Lock()
        self._env = {k: os.environ[k] for k in _HOST_ENV if k in os.environ}
        self._env.update(spec.env)
        self._env["RUNFLEET_SCRATCH_DIR"] = str(spec.scratch_dir)
        self._env["RUNFLEET_WORKSPACE"] = str(spec.workspace_dir)
        if spec.attachments_dir is not None:
            self._env["RUNFLEET_ATTACHMENTS_DIR"] = str(spec.attachments_dir)

    @property
    def name(self) -> str:
        return sandbox_name(self.spec.run_id, self.spec.lease_token)

    async def exec(
        self, command: str, *, timeout_s: float, on_output: OutputCallback | None = None
    ) -> ExecResult:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        unowned = [out_r, err_r]
        readers: list[tuple[asyncio.StreamReader, asyncio.BaseTransport]] = []
        try:
            while unowned:
                readers.append(await _open_reader(unowned.pop(0)))  # it owns the fd now
            proc, group = await self._spawn(command, stdout=out_w, stderr=err_w)
        except BaseException:
            for fd in unowned:
                os.close(fd)
            for _, transport in readers:
                transport.close()
            raise
        finally:
            os.close(out_w)  # the command holds its own copies
            os.close(err_w)
        started = time.monotonic()
        tails = (_Tail(), _Tail())
        timed_out = False
        duration = 0.0
        ended = False
        try:
            async with asyncio.TaskGroup() as tasks:
                pumps = [
                    tasks.create_task(_pump(name, reader, tail, on_output))
                    for name, (reader, _), tail in zip(
                        ("stdout", "stderr"), readers, tails, strict=True
                    )
                ]
                try:
                    async with asyncio.timeout(timeout_s):
                        await proc.wait()
                except TimeoutError:
                    timed_out = True
                duration = time.monotonic() - started
                await asyncio.to_thread(terminate_groups, [group], self._grace)  # node end
                ended = True
                await proc.wait()
                # The pipes close when every holder has exited; one that left the group keeps
                # them open, so the rest of its output is cut off after the grace.
                _, late = await asyncio.wait(pumps, timeout=self._grace)
                for task in late:
                    task.cancel()
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # only `on_output` fails in there
        finally:
            if not ended:
                signal_group(group, signal.SIGKILL)  # cancelled or failed: no grace, no await
            for _, transport in readers:
                transport.close()
        await self._forget(group)
        assert proc.returncode is not None
        return ExecResult(
            exit_code=proc.returncode,
            timed_out=timed_out,
            stdout_tail=bytes(tails[0].data),
            stderr_tail=bytes(tails[1].data),
            duration_s=duration,
        )

    async def _spawn(
        self, command: str, *, stdout: int, stderr: int
    ) -> tuple[asyncio.subprocess.Process, GroupRecord]:
        async with run_lock(self.record_path.parent):
            record = None if self._stopping else read_record(self.record_path)
            if record is None:
                raise SandboxLost(f"sandbox {self.name} was stopped")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *("/bin/sh", "-c", _GATE, "runfleet-sandbox", command),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=stdout,
                    stderr=stderr,
                    cwd=self.spec.workspace_dir,
                    env=self._env,
                    start_new_session=True,
                )
            except OSError as e:
                raise SandboxLost(f"cannot run a command in sandbox {self.name}: {e}") from e
            assert proc.stdin is not None
            try:
                start_time = process_start_time(proc.pid)
                if start_time is None:
                    raise SandboxLost(f"the command of sandbox {self.name} died at the gate")
                group = GroupRecord(proc.pid, start_time)
                self._live[group.pgid] = group
                try:
                    write_record(self.record_path, replace(record, groups=(*record.groups, group)))
                except OSError as e:
                    raise SandboxLost(f"cannot record sandbox {self.name}: {e}") from e
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            finally:
                proc.stdin.close()  # without "go" the gate exits without running the command
        return proc, group

    async def _forget(self, group: GroupRecord) -> None:
        async with run_lock(self.record_path.parent):
            self._live.pop(group.pgid, None)
            record = None if self._stopping else read_record(self.record_path)
            if record is None:
                raise SandboxLost(f"sandbox {self.name} was stopped while a command ran")
            groups = tuple(g for g in record.groups if g != group)
            write_record(self.record_path, replace(record, groups=groups))

    async def copy_out(self, src: Path, dest_tar: Path, *, max_bytes: int | None = None) -> None:
        await asyncio.to_thread(_write_tar, self.spec.workspace_dir / src, dest_tar, max_bytes)

    async def copy_in(self, tar: Path, dest_dir: Path) -> None:
        await asyncio.to_thread(_extract_tar, tar, self.spec.workspace_dir / dest_dir)

    async def stop(self) -> None:
        async with self._stop_lock:
            if self._stopped:
                return
            self._stopping = True
            async with run_lock(self.record_path.parent):
                try:
                    record = read_record(self.record_path)
                except SandboxRecordCorrupt:
                    record = None  # what we started is also in self._live
                groups = {*(record.groups if record else ()), *self._live.values()}
                await asyncio.to_thread(terminate_groups, groups, self._grace)
                self.record_path.unlink(missing_ok=True)
            # Only now: the watchdog reads the record at EOF, and there is none left.
            assert self._watchdog.stdin is not None
            self._watchdog.stdin.close()
            try:
                async with asyncio.timeout(self._grace + 5.0):
                    await self._watchdog.wait()
            except TimeoutError:
                await kill_process(self._watchdog)
            self._stopped = True


class _BoundedFile:
    """The host file of a copy out, refusing the write that would take it past `max_bytes`:
    `tarfile` writes headers, data and the end blocks through here, so the file never holds
    more than the bound, however large the directory is. Write only (`read` and `seek` are
    there for `tarfile`'s file protocol; writing a tar uses neither)."""

    def __init__(self, path: Path, src: Path, max_bytes: int | None) -> None:
        self.handle = path.open("wb")
        self.src = src
        self.max_bytes = max_bytes
        self.written = 0

    def write(self, data: bytes, /) -> int:
        size = len(data)
        if self.max_bytes is not None and self.written + size > self.max_bytes:
            raise SandboxCopyTooLarge(str(self.src), self.max_bytes, self.written + size)
        self.handle.write(data)
        self.written += size
        return size

    def tell(self) -> int:
        return self.written

    def read(self, size: int, /) -> bytes:
        raise io.UnsupportedOperation("a copy out's file is write only")

    def seek(self, pos: int, /) -> int:
        raise io.UnsupportedOperation("a copy out's file is write only")

    def close(self) -> None:
        self.handle.close()


def _write_tar(src: Path, dest: Path, max_bytes: int | None = None) -> None:
    try:
        if not src.is_dir():
            raise SandboxCopyFailed(f"{src} is not a directory")
        with (
            contextlib.closing(_BoundedFile(dest, src, max_bytes)) as sink,
            tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
    except SandboxCopyTooLarge:
        dest.unlink(missing_ok=True)
        raise
    except (OSError, tarfile.TarError) as e:
        dest.unlink(missing_ok=True)
        raise SandboxCopyFailed(f"cannot archive {src} into {dest}: {e}") from e


def _extract_tar(tar_path: Path, dest: Path) -> None:
    try:
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar_path, "r:*") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError) as e:
        raise SandboxArchiveInvalid(f"{tar_path} does not extract into {dest}: {e}") from e
    except OSError as e:
        raise SandboxCopyFailed(f"cannot extract {tar_path} into {dest}: {e}") from e
