"""The kubernetes sandbox's transport: a command in a pod over the API server's exec subresource,
and a directory in or out of the pod as a tar stream over it (SPEC v2.2 §7.1).

The wire is the exec subresource's websocket channel protocol: every binary message starts with
a channel byte (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize); the error channel carries one
`metav1.Status` when the command ends (`Success` → 0, `NonZeroExitCode` → its `ExitCode` cause).
`v5.channel.k8s.io` adds one message, `[255, channel]`, that closes a channel: the only way to
end a command's stdin (KEP-4006: without it `tar -x` fed over stdin waits for more forever).

Why not `kubernetes.aio.stream.WsApiClient` as it is: it offers only `v4.channel.k8s.io` (no
stdin close), and its preloading read decodes every message as UTF-8, joins stdout with stderr
and drops the error channel, so neither streaming nor the exit code survive it. Its
`_preload_content=False` path hands back aiohttp's websocket, though; `_ExecApiClient` keeps all
of the client's code (the URL `connect_get_namespaced_pod_exec` builds, auth from the caller's
`Configuration`, its TLS context and session) and changes one thing: it asks aiohttp for the
subprotocols [v5, v4] so the one the server chose is known. The channels are spoken here.

Errors are translated at this boundary (STYLE.md): an exec refused with 404 means the pod is gone
(`SandboxLost`); any other refusal, a stream that breaks before the command's status arrives, or
a status that is not an exit code is `SandboxExecFailed` — whether the pod itself is lost is the
continuity watch's call (§7.2), never this stream's.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tarfile
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import IO, Any, cast

import aiohttp
from kubernetes.aio.client import ApiClient, CoreV1Api
from kubernetes.aio.stream import WsApiClient
from kubernetes.aio.stream.ws_client import get_websocket_url

from engine.sandbox.errors import (
    SandboxArchiveInvalid,
    SandboxCopyFailed,
    SandboxExecFailed,
    SandboxLost,
)
from engine.sandbox.protocols import OUTPUT_CHUNK_BYTES, OUTPUT_TAIL_BYTES, ExecResult

__all__ = [
    "PROTOCOL_V4",
    "PROTOCOL_V5",
    "TIMED_OUT_EXIT_CODE",
    "copy_in",
    "copy_out",
    "exec_in_pod",
    "exit_code_from_status",
]

PROTOCOL_V5 = "v5.channel.k8s.io"
PROTOCOL_V4 = "v4.channel.k8s.io"
STDIN, STDOUT, STDERR, ERROR = 0, 1, 2, 3
CLOSE = 255
"""v5's control channel: `[CLOSE, channel]` half-closes `channel`."""

TIMED_OUT_EXIT_CODE = -int(signal.SIGTERM)
"""What a timed-out exec reports, as the local driver's (its group ends on SIGTERM). The exec
is abandoned, not killed: the exec subresource has no signal to send, so a driver that must end
the command bounds it inside the pod too (e.g. `timeout`)."""

HEARTBEAT_S = 30.0
"""Websocket pings: a half-open connection to the API server is noticed, not waited on."""

_STDIN_CHUNK = 64 * 1024
_CLOSE_WAIT_S = 2.0
"""How long an abandoned exec waits for the server's close frame (aiohttp's default is 10 s)."""

OnOutput = Callable[[str, bytes], Awaitable[None]]


class _CallbackFailed(Exception):
    """Carries an exception of `on_output` past the translation of transport errors."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _ExecApiClient(WsApiClient):
    """`WsApiClient` whose websocket negotiates the subprotocol (see the module docstring).

    It is a view of the caller's `ApiClient`, not a second client: constructing one loads the
    system's CA certificates (~0.14 s of blocked event loop here) and opens a second session, on
    every exec. So it shares the caller's state (configuration, headers, and the REST client:
    its TLS context and aiohttp session, whose pool the websocket draws one connection from),
    and closing it closes nothing; the caller's client owns the session.
    """

    def __init__(self, api_client: ApiClient) -> None:  # no super().__init__: see above
        self.__dict__.update(vars(api_client))
        self.heartbeat = HEARTBEAT_S

    async def close(self) -> None:
        return None

    async def request(
        self,
        method: str,
        url: str,
        query_params: Any = None,
        headers: dict[str, str] | None = None,
        post_params: Any = None,
        body: Any = None,
        _preload_content: bool = True,
        _request_timeout: Any = None,
    ) -> Any:
        rest = self.rest_client
        if rest.pool_manager is None:
            rest.pool_manager = rest._create_pool_manager()
        return rest.pool_manager.ws_connect(
            get_websocket_url(url),  # type: ignore[no-untyped-call]
            headers=headers,
            protocols=(PROTOCOL_V5, PROTOCOL_V4),
            heartbeat=self.heartbeat,
            timeout=aiohttp.ClientWSTimeout(ws_close=_CLOSE_WAIT_S),
        )


class _Tail:
    def __init__(self) -> None:
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        del self.data[:-OUTPUT_TAIL_BYTES]


def exit_code_from_status(raw: bytes, where: str) -> int:
    """The command's exit code from the error channel's `metav1.Status`; any other status (the
    command could not be started, the container is gone) is `SandboxExecFailed`."""
    try:
        status = json.loads(raw)
    except ValueError as e:
        raise SandboxExecFailed(f"the exec in {where} ended with an unreadable status") from e
    if not isinstance(status, dict):
        raise SandboxExecFailed(f"the exec in {where} ended with an unreadable status")
    if status.get("status") == "Success":
        return 0
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    if status.get("reason") == "NonZeroExitCode" and isinstance(causes, list):
        for cause in causes:
            if isinstance(cause, dict) and cause.get("reason") == "ExitCode":
                try:
                    return int(cause.get("message", ""))
                except ValueError:
                    break
    raise SandboxExecFailed(f"the exec in {where} failed: {status.get('message') or raw!r}")


async def exec_in_pod(
    api: CoreV1Api,
    namespace: str,
    pod: str,
    container: str,
    argv: list[str],
    *,
    timeout: float | None,  # noqa: ASYNC109 (a timed-out exec is a result, not an exception)
    on_output: OnOutput | None = None,
    stdin: bytes | None = None,
) -> ExecResult:
    """Run `argv` in `container` of `pod` to its end. Output goes to `on_output("stdout" |
    "stderr", chunk)` as it arrives, chunks of at most `OUTPUT_CHUNK_BYTES`; the result keeps the
    last `OUTPUT_TAIL_BYTES` of each stream. A non-zero exit is a result, not an error. At
    `timeout` the exec is abandoned and the result has `timed_out=True` and
    `TIMED_OUT_EXIT_CODE`. `stdin` is written and then closed (needs `v5.channel.k8s.io`);
    without it the command's stdin is empty. An exception from `on_output` abandons the exec
    and propagates."""

    async def once() -> AsyncIterator[bytes]:
        assert stdin is not None
        for at in range(0, len(stdin), _STDIN_CHUNK):
            yield stdin[at : at + _STDIN_CHUNK]

    source = None if stdin is None else once()
    return await _exec(api, namespace, pod, container, argv, timeout, on_output, source)


async def _exec(
    api: CoreV1Api,
    namespace: str,
    pod: str,
    container: str,
    argv: list[str],
    timeout_s: float | None,
    on_output: OnOutput | None,
    stdin: AsyncIterator[bytes] | None,
) -> ExecResult:
    where = f"pod {namespace}/{pod}"
    tails = (_Tail(), _Tail())
    started = time.monotonic()
    client = _ExecApiClient(api.api_client)
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            status = await _stream(
                client, namespace, pod, container, argv, where, tails, on_output, stdin
            )
    except TimeoutError:
        if not deadline.expired():
            raise
        return ExecResult(
            exit_code=TIMED_OUT_EXIT_CODE,
            timed_out=True,
            stdout_tail=bytes(tails[0].data),
            stderr_tail=bytes(tails[1].data),
            duration_s=time.monotonic() - started,
        )
    return ExecResult(
        exit_code=exit_code_from_status(status, where),
        timed_out=False,
        stdout_tail=bytes(tails[0].data),
        stderr_tail=bytes(tails[1].data),
        duration_s=time.monotonic() - started,
    )


async def _stream(
    client: _ExecApiClient,
    namespace: str,
    pod: str,
    container: str,
    argv: list[str],
    where: str,
    tails: tuple[_Tail, _Tail],
    on_output: OnOutput | None,
    stdin: AsyncIterator[bytes] | None,
) -> bytes:
    """The raw status of one exec, read to the end of the stream."""
    try:
        opened = await CoreV1Api(client).connect_get_namespaced_pod_exec_without_preload_content(
            pod,
            namespace,
            command=argv,
            container=container,
            stdin=stdin is not None,
            stdout=True,
            stderr=True,
            tty=False,
        )
        # typed as a response; `_ExecApiClient.request` made it aiohttp's websocket opener
        connect = cast(AbstractAsyncContextManager[aiohttp.ClientWebSocketResponse], opened)
        async with connect as ws:
            if stdin is not None and ws.protocol != PROTOCOL_V5:
                raise SandboxExecFailed(
                    f"the API server of {where} cannot close an exec's stdin (it chose "
                    f"{ws.protocol or 'no subprotocol'}; {PROTOCOL_V5} is needed, "
                    "Kubernetes ≥ 1.30)"
                )
            try:
                async with asyncio.TaskGroup() as tasks:
                    feeder = None if stdin is None else tasks.create_task(_feed(ws, stdin))
                    status = await _read(ws, where, tails, on_output)
                    if feeder is not None:
                        feeder.cancel()  # the command ended: the rest of its input is moot
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
    except _CallbackFailed as failed:
        raise failed.error from None
    except aiohttp.WSServerHandshakeError as e:
        if e.status == 404:
            raise SandboxLost(f"{where} is gone: the exec was refused with 404") from e
        raise SandboxExecFailed(
            f"the API server refused the exec in {where}: HTTP {e.status}"
        ) from e
    except (aiohttp.ClientError, OSError) as e:
        raise SandboxExecFailed(f"the exec stream of {where} broke: {e!r}") from e
    return status


async def _feed(ws: aiohttp.ClientWebSocketResponse, source: AsyncIterator[bytes]) -> None:
    prefix = bytes([STDIN])
    try:
        async for chunk in source:
            await ws.send_bytes(prefix + chunk)
        await ws.send_bytes(bytes([CLOSE, STDIN]))
    except (aiohttp.ClientError, ConnectionError):
        return  # the stream closed under us: the reader reports how it ended


async def _read(
    ws: aiohttp.ClientWebSocketResponse,
    where: str,
    tails: tuple[_Tail, _Tail],
    on_output: OnOutput | None,
) -> bytes:
    status: bytes | None = None
    async for msg in ws:  # ends when the server closes
        if msg.type is aiohttp.WSMsgType.ERROR:
            raise SandboxExecFailed(f"the exec stream of {where} broke: {ws.exception()!r}")
        if msg.type is aiohttp.WSMsgType.BINARY:
            data: bytes = msg.data
        elif msg.type is aiohttp.WSMsgType.TEXT:
            data = msg.data.encode()
        else:
            continue
        if len(data) < 2:
            continue  # an empty message opens a channel
        channel, payload = data[0], data[1:]
        if channel in (STDOUT, STDERR):
            name = "stdout" if channel == STDOUT else "stderr"
            tails[channel - 1].add(payload)
            if on_output is not None:
                for at in range(0, len(payload), OUTPUT_CHUNK_BYTES):
                    try:
                        await on_output(name, payload[at : at + OUTPUT_CHUNK_BYTES])
                    except Exception as e:
                        raise _CallbackFailed(e) from e
        elif channel == ERROR:
            status = payload if status is None else status + payload
    if status is None:
        raise SandboxExecFailed(
            f"the exec stream of {where} closed before the command's status "
            f"(close code {ws.close_code})"
        )
    return status


async def copy_in(
    api: CoreV1Api, namespace: str, pod: str, container: str, tar_path: Path, dest_dir: str
) -> None:
    """Extract the host tar `tar_path` (plain or gzip) into `dest_dir` in the pod, creating it,
    by streaming it to `tar -x` over stdin. The archive is checked on the host first: a member
    that would escape `dest_dir`, a device file or an absolute link is `SandboxArchiveInvalid`
    and nothing is sent; a failure on the way or of the pod's tar is `SandboxCopyFailed`."""
    gzipped = await asyncio.to_thread(_check_archive, tar_path)
    script = 'mkdir -p -- "$1" && exec tar -x -f - -C "$1" ' + ("-z" if gzipped else "")
    argv = ["sh", "-c", script.strip(), "runfleet-copy-in", dest_dir]
    try:
        handle = await asyncio.to_thread(tar_path.open, "rb")
    except OSError as e:
        raise SandboxCopyFailed(f"cannot read {tar_path}: {e}") from e
    try:
        result = await _exec(
            api, namespace, pod, container, argv, None, None, _chunks(handle, tar_path)
        )
    finally:
        handle.close()
    if result.exit_code != 0:
        raise SandboxCopyFailed(
            f"tar in pod {namespace}/{pod} could not extract {tar_path.name} into {dest_dir} "
            f"(exit {result.exit_code}): {result.stderr_tail.decode(errors='replace').strip()}"
        )


async def _chunks(handle: IO[bytes], path: Path) -> AsyncIterator[bytes]:
    while True:
        try:
            chunk = await asyncio.to_thread(handle.read, _STDIN_CHUNK)
        except OSError as e:
            raise SandboxCopyFailed(f"cannot read {path}: {e}") from e
        if not chunk:
            return
        yield chunk


def _check_archive(tar_path: Path) -> bool:
    """Whether the archive is gzipped, once every member passed the `data` extraction filter."""
    try:
        with tar_path.open("rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        with tarfile.open(tar_path, "r:*") as tar:
            for member in tar:
                tarfile.data_filter(member, "/runfleet-dest")
    except tarfile.FilterError as e:
        raise SandboxArchiveInvalid(f"{tar_path} has a member that is refused: {e}") from e
    except (tarfile.TarError, EOFError) as e:
        raise SandboxArchiveInvalid(f"{tar_path} is not a readable tar archive: {e}") from e
    except OSError as e:
        raise SandboxCopyFailed(f"cannot read {tar_path}: {e}") from e
    return gzipped


async def copy_out(
    api: CoreV1Api,
    namespace: str,
    pod: str,
    container: str,
    src_dir: str,
    dest_tar: Path,
    *,
    gzip_level: int | None = 6,
) -> None:
    """Write the pod's directory `src_dir` as a tar to the host file `dest_tar`, members relative
    to `src_dir`. It is gzipped on the host at `gzip_level` (0-9, always explicit: the pod's tar
    may be BusyBox's, which takes no level), or plain with `gzip_level=None`. On any failure the
    file is removed and `SandboxCopyFailed` (or `SandboxLost`) raised."""
    if gzip_level is not None and not 0 <= gzip_level <= 9:
        raise ValueError(f"gzip_level must be 0-9 or None, not {gzip_level}")
    sink = await asyncio.to_thread(_Sink.open, dest_tar, gzip_level)

    async def on_output(stream: str, chunk: bytes) -> None:
        if stream == "stdout":
            await asyncio.to_thread(sink.write, chunk)

    argv = ["tar", "-c", "-f", "-", "-C", src_dir, "."]
    try:
        result = await _exec(api, namespace, pod, container, argv, None, on_output, None)
        if result.exit_code != 0:
            raise SandboxCopyFailed(
                f"tar in pod {namespace}/{pod} could not archive {src_dir} "
                f"(exit {result.exit_code}): {result.stderr_tail.decode(errors='replace').strip()}"
            )
        await asyncio.to_thread(sink.finish)
    except BaseException:
        await asyncio.to_thread(sink.discard)
        raise


class _Sink:
    """The host side of `copy_out`: the tar stream, gzipped or not, into a file."""

    def __init__(self, path: Path, handle: IO[bytes], level: int | None) -> None:
        self.path = path
        self.handle = handle
        self.gzip = None if level is None else zlib.compressobj(level, zlib.DEFLATED, 31)

    @classmethod
    def open(cls, path: Path, level: int | None) -> _Sink:
        try:
            return cls(path, path.open("wb"), level)
        except OSError as e:
            raise SandboxCopyFailed(f"cannot write {path}: {e}") from e

    def write(self, chunk: bytes) -> None:
        try:
            self.handle.write(chunk if self.gzip is None else self.gzip.compress(chunk))
        except OSError as e:
            raise SandboxCopyFailed(f"cannot write {self.path}: {e}") from e

    def finish(self) -> None:
        try:
            if self.gzip is not None:
                self.handle.write(self.gzip.flush())
            self.handle.close()
        except OSError as e:
            raise SandboxCopyFailed(f"cannot write {self.path}: {e}") from e

    def discard(self) -> None:
        self.handle.close()
        self.path.unlink(missing_ok=True)
