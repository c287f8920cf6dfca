"""The kubernetes sandbox's transport: a command in a pod over the API server's exec subresource
(SPEC v2.2 §7.1); `copy.py` moves directories in and out as tar streams over it.

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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

import aiohttp
from kubernetes.aio.client import ApiClient, CoreV1Api
from kubernetes.aio.stream import WsApiClient
from kubernetes.aio.stream.ws_client import get_websocket_url

from engine.sandbox.errors import (
    SandboxExecFailed,
    SandboxLost,
)
from engine.sandbox.protocols import OUTPUT_CHUNK_BYTES, OUTPUT_TAIL_BYTES, ExecResult

__all__ = [
    "PROTOCOL_V4",
    "PROTOCOL_V5",
    "TIMED_OUT_EXIT_CODE",
    "exec_in_pod",
    "exec_raw",
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

STDIN_CHUNK = 64 * 1024
_CLOSE_WAIT_S = 2.0
"""How long an abandoned exec waits for the server's close frame (aiohttp's default is 10 s)."""

OnOutput = Callable[[str, bytes], Awaitable[None]]


class _CallbackFailed(Exception):
    """Carries an exception of `on_output` (its one argument) past the translation of transport
    errors."""


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

    async def request(  # the signature of `WsApiClient.request`; only `url` and `headers` count
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
        """Called by `call_api` with the URL `param_serialize` built (query, auth and all)."""
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
        if status.get("status") == "Success":
            return 0
        if status.get("reason") == "NonZeroExitCode":
            causes = status["details"]["causes"]
            return int(next(c["message"] for c in causes if c.get("reason") == "ExitCode"))
        message = status.get("message")
    except (ValueError, TypeError, KeyError, AttributeError, StopIteration) as e:
        raise SandboxExecFailed(f"the exec in {where} ended with an unreadable status") from e
    raise SandboxExecFailed(f"the exec in {where} failed: {message or raw!r}")


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
        for at in range(0, len(stdin), STDIN_CHUNK):
            yield stdin[at : at + STDIN_CHUNK]

    source = None if stdin is None else once()
    return await exec_raw(api, namespace, pod, container, argv, timeout, on_output, source)


async def exec_raw(
    api: CoreV1Api,
    namespace: str,
    pod: str,
    container: str,
    argv: list[str],
    timeout_s: float | None,
    on_output: OnOutput | None,
    stdin: AsyncIterator[bytes] | None,
) -> ExecResult:
    call = _Call(_ExecApiClient(api.api_client), namespace, pod, container, on_output)
    started = time.monotonic()
    deadline = asyncio.timeout(timeout_s)
    status: bytes | None = None
    try:
        async with deadline:
            status = await call.run(argv, stdin)
    except TimeoutError:
        if not deadline.expired():
            raise
    return ExecResult(
        exit_code=TIMED_OUT_EXIT_CODE
        if status is None
        else exit_code_from_status(status, call.where),
        timed_out=status is None,
        stdout_tail=bytes(call.tails[0].data),
        stderr_tail=bytes(call.tails[1].data),
        duration_s=time.monotonic() - started,
    )


class _Call:
    """One exec: its stream, and the tails of its output."""

    def __init__(
        self,
        client: _ExecApiClient,
        namespace: str,
        pod: str,
        container: str,
        on_output: OnOutput | None,
    ) -> None:
        self.client, self.namespace, self.pod, self.container = client, namespace, pod, container
        self.on_output = on_output
        self.where = f"pod {namespace}/{pod}"
        self.tails = (_Tail(), _Tail())

    async def run(self, argv: list[str], stdin: AsyncIterator[bytes] | None) -> bytes:
        """The raw status of the exec, read to the end of its stream."""
        where = self.where
        try:
            opened = await CoreV1Api(
                self.client
            ).connect_get_namespaced_pod_exec_without_preload_content(
                self.pod,
                self.namespace,
                command=argv,
                container=self.container,
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
                        status = await self._read(ws)
                        if feeder is not None:
                            feeder.cancel()  # the command ended: the rest of its input is moot
                except BaseExceptionGroup as failed:
                    raise failed.exceptions[0] from None
        except _CallbackFailed as failed:
            raise failed.args[0] from None
        except aiohttp.WSServerHandshakeError as e:
            if e.status == 404:
                raise SandboxLost(f"{where} is gone: the exec was refused with 404") from e
            raise SandboxExecFailed(
                f"the API server refused the exec in {where}: {e.status}"
            ) from e
        except (aiohttp.ClientError, OSError) as e:
            raise SandboxExecFailed(f"the exec stream of {where} broke: {e!r}") from e
        return status

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> bytes:
        status: bytes | None = None
        async for msg in ws:  # ends when the server closes
            if msg.type is aiohttp.WSMsgType.ERROR:
                raise SandboxExecFailed(
                    f"the exec stream of {self.where} broke: {ws.exception()!r}"
                )
            if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            data: bytes = msg.data if msg.type is aiohttp.WSMsgType.BINARY else msg.data.encode()
            if len(data) < 2:
                continue  # an empty message opens a channel
            channel, payload = data[0], data[1:]
            if channel == ERROR:
                status = payload if status is None else status + payload
            elif channel in (STDOUT, STDERR):
                self.tails[channel - 1].add(payload)
                if self.on_output is not None:
                    await self._hand_on("stdout" if channel == STDOUT else "stderr", payload)
        if status is None:
            raise SandboxExecFailed(
                f"the exec stream of {self.where} closed before the command's status "
                f"(close code {ws.close_code})"
            )
        return status

    async def _hand_on(self, name: str, payload: bytes) -> None:
        assert self.on_output is not None
        for at in range(0, len(payload), OUTPUT_CHUNK_BYTES):
            try:
                await self.on_output(name, payload[at : at + OUTPUT_CHUNK_BYTES])
            except Exception as e:
                raise _CallbackFailed(e) from e


async def _feed(ws: aiohttp.ClientWebSocketResponse, source: AsyncIterator[bytes]) -> None:
    prefix = bytes([STDIN])
    try:
        async for chunk in source:
            await ws.send_bytes(prefix + chunk)
        await ws.send_bytes(bytes([CLOSE, STDIN]))
    except (aiohttp.ClientError, ConnectionError):
        return  # the stream closed under us: the reader reports how it ended
