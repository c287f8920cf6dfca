"""A local JetStream cluster: N `nats-server` processes on 127.0.0.1 routed to each other
(`runfleet up --nats-cluster 3`, and the tests' cluster; NOTES.md, "A JetStream cluster on one
machine").

Every node is a `NatsServer` with a temp store of its own; the ports (client, route, monitoring)
are chosen up front because each node's routes must name all of its peers before any of them
starts. A node's client port being open does not mean JetStream works: until a meta leader is
elected the JetStream API answers 503. So readiness is each node's `/healthz`, which answers ok
only once that node has a meta leader and its streams and consumers are current — the same wait
serves a restarted node catching up. Like `NatsServer`, every call blocks: run it in a thread
from async code.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from runner.localnats import NatsServer, find_nats_server

CLUSTER_NAME = "runfleet"
_READY_TIMEOUT_S = 30.0
_POLL_S = 0.05


def free_ports(count: int) -> list[int]:
    """`count` distinct ports the kernel just handed out (held together, so none repeats)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class NatsCluster:
    """`size` JetStream servers named n1..nN in one cluster; nodes are addressed by index."""

    def __init__(
        self,
        work_dir: Path,
        size: int = 3,
        *,
        binary: Path | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        binary = binary or find_nats_server()
        ports = free_ports(3 * size)
        client, route, monitor = ports[:size], ports[size : 2 * size], ports[2 * size :]
        routes = ",".join(f"nats-route://127.0.0.1:{p}" for p in route)
        self.monitor_ports = monitor
        self.nodes = [
            NatsServer(
                work_dir / f"n{k + 1}",
                binary=binary,
                port=client[k],
                extra_args=[
                    "--server_name",
                    f"n{k + 1}",
                    "--cluster_name",
                    CLUSTER_NAME,
                    "--cluster",
                    f"nats://127.0.0.1:{route[k]}",
                    "--routes",
                    routes,
                    "-m",
                    str(monitor[k]),
                ],
                pass_fds=pass_fds,
            )
            for k in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The comma-separated list `RUNFLEET_NATS_URL` accepts."""
        return ",".join(self.urls)

    def name(self, index: int) -> str:
        return f"n{index + 1}"

    def index_of(self, name: str) -> int:
        """The node index of a server name (`n2` -> 1), as JetStream's cluster info names it."""
        for k in range(len(self.nodes)):
            if self.name(k) == name:
                return k
        raise KeyError(f"no node named {name!r} in this cluster")

    def index_of_url(self, url: str) -> int:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        for k, node in enumerate(self.nodes):
            if node.port == port:
                return k
        raise KeyError(f"no node listens on {url}")

    def start(self, timeout: float = _READY_TIMEOUT_S) -> None:
        """Start every node, then wait until each one's JetStream is ready."""
        try:
            for node in self.nodes:
                node.start()
            self.wait_ready(range(len(self.nodes)), timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def restart(self, index: int, timeout: float = _READY_TIMEOUT_S) -> None:
        """Start a stopped or killed node again (same ports, same store) and wait until it has
        caught up; a running node is stopped first."""
        self.nodes[index].stop()
        self.nodes[index].start()
        self.wait_ready([index], timeout)

    def pause(self, index: int) -> None:
        self.nodes[index].pause()

    def resume(self, index: int) -> None:
        self.nodes[index].resume()

    def wait_ready(self, indexes: range | list[int], timeout: float = _READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for k in indexes:
            while (status := self.health(k)) != "ok":
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"nats node {self.name(k)} not ready within {timeout}s ({status}):\n"
                        f"{self.nodes[k].log_tail()}"
                    )
                time.sleep(_POLL_S)

    def health(self, index: int) -> str:
        """`ok`, or why the node's `/healthz` says it is not ready."""
        url = f"http://127.0.0.1:{self.monitor_ports[index]}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        except OSError as exc:
            return f"unreachable: {exc}"
        try:
            answer = json.loads(body)
        except json.JSONDecodeError:
            return f"unreadable: {body[:200]!r}"
        if answer.get("status") == "ok":
            return "ok"
        return str(answer.get("error") or answer)
