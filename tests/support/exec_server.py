"""A local stand-in for the API server's exec subresource: real commands behind the real wire.

`ExecServer` answers `GET /api/v1/namespaces/{ns}/pods/{pod}/exec` with the websocket channel
protocol (`v5.channel.k8s.io` and `v4.channel.k8s.io`: a channel byte before every binary
message, 0 stdin, 1 stdout, 2 stderr, 3 error; v5's `[255, 0]` closes stdin) and runs the
`command` query arguments as a local subprocess, so a client's streaming, exit codes (the
`metav1.Status` on channel 3), timeouts and tar in/out run for real. It binds 127.0.0.1 on a free
port; nothing is mocked on the client side.

The pod's filesystem: each pod gets a directory `root/<ns>/<pod>/` (its cwd), and any argument
naming one of `mounts` (`/workspace`, `/scratch`, `/run/runfleet/attachments` by default, the
emptyDirs of SPEC §7.1, §8), alone or inside a shell script, is rewritten to that directory's
copy, so `tar -x -C /workspace/x` lands in `root/<ns>/<pod>/workspace/x`. Other absolute
paths are the host's: it is a test double, not a chroot.

Faults: `delete_pod(ns, pod)` kills the pod's commands (their status says exit 137, as a
kubelet's would for a deleted pod) and answers later execs with 404; `break_connections(ns,
pod)` aborts the TCP connections of its execs mid-stream (a network failure: no status). A
client that goes away kills its command's process group, unless `orphans=True`: then, as on a
real kubelet, a command whose stream closed runs on until it ends or its pod is deleted.
`protocols=(PROTOCOL_V4,)` makes an API server too old to close stdin.

With kmock (one host for the API and exec): kmock's handler is a plain aiohttp handler, so the
exec server can front it; every request that is not an exec goes to `fallback`::

    async with (
        kmock.KubernetesEmulator() as emulator,
        ExecServer(tmp_path, fallback=emulator) as srv,
    ):
        configuration.host = srv.url  # pods through kmock, execs here

`add_routes(app)` mounts the exec route on another aiohttp app instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import WSMsgType, web

__all__ = ["EXEC_ROUTE", "PROTOCOL_V4", "PROTOCOL_V5", "ExecServer"]

PROTOCOL_V5 = "v5.channel.k8s.io"
PROTOCOL_V4 = "v4.channel.k8s.io"
EXEC_ROUTE = "/api/v1/namespaces/{namespace}/pods/{pod}/exec"
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
_CHUNK = 32 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _status(code: int) -> bytes:
    if code == 0:
        return json.dumps({"metadata": {}, "status": "Success"}).encode()
    return json.dumps(
        {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: exit status {code}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
        }
    ).encode()


def _failure(status: int, reason: str, message: str) -> web.Response:
    body: dict[str, object] = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
    body |= {"message": message, "reason": reason, "code": status}
    return web.json_response(body, status=status)


class ExecServer:
    def __init__(
        self,
        root: Path,
        *,
        protocols: Sequence[str] = (PROTOCOL_V5, PROTOCOL_V4),
        mounts: Sequence[str] = ("/workspace", "/scratch", "/run/runfleet/attachments"),
        fallback: Handler | None = None,
        orphans: bool = False,
    ) -> None:
        self.root = root
        self.protocols = tuple(protocols)
        self.mounts = tuple(mounts)
        self.fallback = fallback
        self.orphans = orphans
        self._orphaned: dict[tuple[str, str], set[asyncio.subprocess.Process]] = {}
        self._reapers: set[asyncio.Task[int]] = set()
        self.gone: set[tuple[str, str]] = set()
        self.execs: list[tuple[str, str, list[str]]] = []
        """Every exec served: (namespace, pod, command as sent)."""
        self._live: dict[tuple[str, str], dict[asyncio.subprocess.Process, web.Request]] = {}
        self._mount_re = re.compile(
            r"(?<![\w./-])(" + "|".join(re.escape(m) for m in self.mounts) + r")(?=/|$|[^\w.-])"
        )
        self.app = web.Application()
        self.add_routes(self.app)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(EXEC_ROUTE, self.handle)
        if self.fallback is not None:
            app.router.add_route("*", "/{tail:.*}", self._fallback)

    def pod_root(self, namespace: str, pod: str) -> Path:
        """The pod's directory, with one directory per mount."""
        root = self.root / namespace / pod
        for mount in self.mounts:
            (root / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
        return root

    def delete_pod(self, namespace: str, pod: str) -> None:
        self.gone.add((namespace, pod))
        for proc in [
            *self._live.get((namespace, pod), {}),
            *self._orphaned.get((namespace, pod), ()),
        ]:
            _kill(proc)

    def break_connections(self, namespace: str, pod: str) -> int:
        """Abort the connections of the pod's execs in flight; how many there were."""
        live = list(self._live.get((namespace, pod), {}).values())
        for request in live:
            if request.transport is not None:
                request.transport.abort()
        return len(live)

    def live_execs(self, namespace: str, pod: str) -> int:
        return len(self._live.get((namespace, pod), {}))

    async def __aenter__(self) -> ExecServer:
        self._runner = web.AppRunner(self.app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for procs in [*self._live.values(), *self._orphaned.values()]:
            for proc in procs:
                _kill(proc)
        await asyncio.gather(*self._reapers, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _fallback(self, request: web.Request) -> web.StreamResponse:
        assert self.fallback is not None
        return await self.fallback(request)

    def _rewrite(self, arg: str, root: Path) -> str:
        return self._mount_re.sub(lambda m: f"{root}{m.group(1)}", arg)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        namespace, pod = request.match_info["namespace"], request.match_info["pod"]
        if (namespace, pod) in self.gone:
            return _failure(404, "NotFound", f'pods "{pod}" not found')
        command = request.query.getall("command", [])
        if not command:
            return _failure(400, "BadRequest", "you must specify at least 1 command")
        self.execs.append((namespace, pod, list(command)))
        ws = web.WebSocketResponse(protocols=self.protocols, autoping=True)
        if not ws.can_prepare(request).ok:
            return _failure(400, "BadRequest", "not a websocket upgrade for a known protocol")
        await ws.prepare(request)
        root = self.pod_root(namespace, pod)
        wants_stdin = request.query.get("stdin") == "true"
        try:
            proc = await asyncio.create_subprocess_exec(
                *(self._rewrite(arg, root) for arg in command),
                cwd=root,
                stdin=asyncio.subprocess.PIPE if wants_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env={**os.environ, "RUNFLEET_POD_ROOT": str(root)},
            )
        except OSError as e:
            failure = {"metadata": {}, "status": "Failure", "reason": "InternalError"}
            failure["message"] = f"OCI runtime exec failed: {e}"
            await ws.send_bytes(bytes([ERROR]) + json.dumps(failure).encode())
            await ws.close()
            return ws
        live = self._live.setdefault((namespace, pod), {})
        live[proc] = request
        try:
            await self._serve(ws, proc)
        finally:
            live.pop(proc, None)
            if self.orphans and proc.returncode is None:
                self._orphan((namespace, pod), proc)
            else:
                _kill(proc)
                try:
                    await proc.wait()  # SIGKILLed: at once
                finally:
                    # Cancelled in that wait (the server stopping with a stream just cut), the
                    # pipes were left open and reported as a leak at collection, failing
                    # whichever test ran then (seen under load).
                    proc._transport.close()  # type: ignore[attr-defined]
        return ws

    def _orphan(self, key: tuple[str, str], proc: asyncio.subprocess.Process) -> None:
        """A kubelet's orphan: the stream is gone and the command runs on; reaped when it ends."""
        orphaned = self._orphaned.setdefault(key, set())
        orphaned.add(proc)
        reaper = asyncio.create_task(proc.wait())
        self._reapers.add(reaper)

        def reaped(task: asyncio.Task[int]) -> None:
            self._reapers.discard(task)
            orphaned.discard(proc)

        reaper.add_done_callback(reaped)

    async def _serve(self, ws: web.WebSocketResponse, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        reader = asyncio.create_task(self._stdin(ws, proc))
        pumps = [
            asyncio.create_task(_pump(ws, STDOUT, proc.stdout)),
            asyncio.create_task(_pump(ws, STDERR, proc.stderr)),
        ]

        async def finished() -> None:
            await asyncio.gather(*pumps, proc.wait())

        done = asyncio.create_task(finished())
        try:
            await asyncio.wait([reader, done], return_when=asyncio.FIRST_COMPLETED)
            if not done.done() or done.exception() is not None:
                if not self.orphans:
                    _kill(proc)  # the client went away: abandon the command
                return
            assert proc.returncode is not None
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            with contextlib.suppress(ConnectionError):
                await ws.send_bytes(bytes([ERROR]) + _status(code))
        finally:
            for task in (reader, done, *pumps):
                task.cancel()
            await asyncio.gather(reader, done, *pumps, return_exceptions=True)
            with contextlib.suppress(ConnectionError):
                await ws.close()
            if proc.returncode is None:
                _drop_output(proc)

    async def _stdin(self, ws: web.WebSocketResponse, proc: asyncio.subprocess.Process) -> None:
        """Channel 0 into the command's stdin until the client closes the stream."""
        async for msg in ws:
            if msg.type is not WSMsgType.BINARY or not msg.data:
                continue
            data: bytes = msg.data
            if data[0] == STDIN and proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.write(data[1:])
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.drain()
            elif data[:2] == bytes([CLOSE, STDIN]) and ws.ws_protocol == PROTOCOL_V5 and proc.stdin:
                proc.stdin.close()


async def _pump(ws: web.WebSocketResponse, channel: int, stream: asyncio.StreamReader) -> None:
    prefix = bytes([channel])
    while chunk := await stream.read(_CHUNK):
        await ws.send_bytes(prefix + chunk)


def _kill(proc: Any) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _drop_output(proc: asyncio.subprocess.Process) -> None:
    """A command whose stream was cut (killed, or left as an orphan) loses its output pipes,
    as under a container runtime, so one still writing dies of SIGPIPE. Otherwise it blocks on
    a pipe nobody reads, and that paused pipe keeps `Process.wait` (which waits for the pipes
    too), and with it the server's shutdown, from ever ending."""
    transport: asyncio.SubprocessTransport = proc._transport  # type: ignore[attr-defined]
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd)
        if pipe is not None:
            pipe.close()
