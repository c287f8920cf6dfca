"""The continuity watch of a running kubernetes sandbox, and the pod-side quiesce (SPEC §7.2, §7.3).

The watch answers, the lease asserts (the seeds' ADR-0021): a pod that is gone is known from the
API server's own watch within milliseconds, not at the next lease beat, so the node running in it
fails `SANDBOX_LOST` at once and the exec in flight is abandoned (`asyncio.wait({exec, lost})`).

One `PodWatch` per sandbox, from Ready to teardown: list the pod by name, judge it, then watch from
the list's resourceVersion and judge every event. What counts as loss (`judge_pod`):

    no pod of that name                 deleted     (also: a DELETED event for our UID)
    a pod of that name, another UID     replaced    (someone recreated it: not ours, §7.2)
    status.reason NodeLost              node_lost   (the node controller gave up on its node)
    phase Failed, reason Evicted        evicted     (an eviction keeps the UID)
    phase Failed, any other reason      failed
    phase Succeeded                     succeeded   (restartPolicy Never: the container ended)
    deletionTimestamp set               deleted     (terminating: the kubelet is killing it, and
                                                     on a lost node DELETED never comes)

Not loss: phase Unknown or a Ready condition gone False/Unknown without NodeLost (the API server
cannot reach the kubelet: that is *unknown*, like a dropped watch, and the lease decides), Pending,
Running. A dropped watch (the stream ends, 410 Gone, a connection error, a client timeout) is
unknown, never loss: fabricating loss would fail live nodes the first time the API server
hiccuped. The watch re-lists and reconciles with a bounded backoff, for as long as it runs.

The driver stops the watch before its own teardown deletes the pod, or it would see its own
delete as a loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass

import aiohttp
from kubernetes.aio import client, watch

__all__ = [
    "Loss",
    "PodWatch",
    "QuiesceReport",
    "judge_event",
    "judge_pod",
    "parse_quiesce_report",
    "quiesce_command",
    "quiesce_script",
]

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 120
"""The server-side `timeoutSeconds` of one watch; the client's total timeout is this plus
`_CLIENT_MARGIN_S`, so a half-open connection is noticed and re-listed within ~2 min."""
_CLIENT_MARGIN_S = 15.0
LIST_TIMEOUT_S = 15.0
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0
"""Re-lists after consecutive fruitless watches wait 0.2 s, 0.4 s, ... at most 5 s."""

_TRANSIENT = (client.ApiException, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
"""What a dropped or refused watch or list raises: all *unknown*, never loss. (`ValueError`:
the client's unmarshalling of a garbled line.)"""


@dataclass(frozen=True, slots=True)
class Loss:
    """The pod is gone for this execution: `reason` goes into `sandbox_lost {reason, message}`."""

    reason: str
    message: str


def judge_pod(pod: client.V1Pod | None, uid: str) -> Loss | None:
    """The pod as listed or watched (None: no pod of that name) against the UID we started."""
    if pod is None:
        return Loss("deleted", "the pod no longer exists")
    meta = pod.metadata
    if meta is None or meta.uid != uid:
        other = meta.uid if meta is not None else None
        return Loss("replaced", f"the pod of that name has UID {other}, not {uid}")
    status = pod.status
    phase = status.phase if status is not None else None
    why = _status_words(pod)
    if status is not None and status.reason == "NodeLost":
        return Loss("node_lost", f"the pod's node was lost (phase {phase}){why}")
    if phase == "Failed":
        reason = "evicted" if status is not None and status.reason == "Evicted" else "failed"
        return Loss(reason, f"the pod failed{why}")
    if phase == "Succeeded":
        return Loss("succeeded", f"the pod's containers ended{why}")
    if meta.deletion_timestamp is not None:
        return Loss("deleted", f"the pod is being deleted (since {meta.deletion_timestamp}){why}")
    return None


def judge_event(kind: str, pod: client.V1Pod, uid: str) -> Loss | None:
    """A watch event: DELETED of our UID is deletion; anything else is judged by the pod."""
    if kind == "DELETED" and pod.metadata is not None and pod.metadata.uid == uid:
        return Loss("deleted", f"the pod was deleted{_status_words(pod)}")
    return judge_pod(pod, uid)


def _status_words(pod: client.V1Pod) -> str:
    """`: <reason>; <message>; <DisruptionTarget reason>; container <name> <reason> (exit <n>)`
    when the pod says why, else ''."""
    status = pod.status
    if status is None:
        return ""
    words = [w for w in (status.reason, status.message) if w]
    words += [
        f"{c.reason}: {c.message}" if c.message else str(c.reason)
        for c in status.conditions or ()
        if c.type == "DisruptionTarget" and c.status == "True" and c.reason
    ]
    for c in status.container_statuses or ():
        ended = c.state.terminated if c.state is not None else None
        if ended is not None:
            words.append(f"container {c.name} {ended.reason or 'ended'} (exit {ended.exit_code})")
    return f": {'; '.join(words)}" if words else ""


class PodWatch:
    """One pod's continuity watch; `run()` until `stop()`, `lost` set at most once."""

    def __init__(self, api: client.CoreV1Api, namespace: str, name: str, uid: str) -> None:
        self._api = api
        self._namespace = namespace
        self._name = name
        self._uid = uid
        self.lost = asyncio.Event()
        self.reason: str | None = None
        self.message: str | None = None
        self._stopped = asyncio.Event()
        self._events = 0
        """Events delivered by the current watch: a watch that delivered any resets the backoff."""

    def stop(self) -> None:
        """End `run()`; idempotent. After a loss `run()` idles until this, so its owner has one
        way to end it whatever happened."""
        self._stopped.set()

    async def run(self) -> None:
        """Watch until `stop()`. Errors that are not the API's (a bug) propagate."""
        follow = asyncio.create_task(self._follow(), name=f"pod-watch:{self._name}")
        stopped = asyncio.create_task(self._stopped.wait())
        try:
            await asyncio.wait({follow, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (follow, stopped):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopped
            # a cancelled follow ends with CancelledError; any other exception is a bug to surface
            try:
                await follow
            except asyncio.CancelledError:
                if not follow.cancelled():
                    raise
        await self._stopped.wait()

    async def _follow(self) -> None:
        """List, judge, watch, judge each event; on a drop, back off and list again."""
        fruitless = 0
        while True:
            if fruitless:
                await asyncio.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (fruitless - 1)))
            try:
                pod, resource_version = await self._list()
            except _TRANSIENT as exc:
                fruitless += 1
                log.warning("pod %s: re-list failed (%r), unknown: retrying", self._name, exc)
                continue
            if self._judged(judge_pod(pod, self._uid), "listed"):
                return
            self._events = 0
            try:
                if await self._stream(resource_version):
                    return
                log.info("pod %s: watch ended, re-listing", self._name)
            except _TRANSIENT as exc:
                log.warning("pod %s: watch dropped (%r), unknown: re-listing", self._name, exc)
            fruitless = 0 if self._events else fruitless + 1

    async def _list(self) -> tuple[client.V1Pod | None, str]:
        pods = await self._api.list_namespaced_pod(
            self._namespace,
            field_selector=f"metadata.name={self._name}",
            _request_timeout=LIST_TIMEOUT_S,
        )
        version = pods.metadata.resource_version if pods.metadata is not None else None
        if not version:
            raise ValueError("the pod list has no resourceVersion")
        named = [p for p in pods.items if p.metadata is not None and p.metadata.name == self._name]
        return (named[0] if named else None), version

    async def _stream(self, resource_version: str) -> bool:
        """Follow one watch; True when it judged the pod lost, False when the stream ended."""
        # `timeout_seconds` makes the client's Watch hand every end and every 410 to us instead
        # of reconnecting on its own from a resourceVersion: a drop must re-list (§7.2).
        w = watch.Watch()  # type: ignore[no-untyped-call]
        async with w:
            stream = w.stream(  # type: ignore[no-untyped-call]
                self._api.list_namespaced_pod,
                self._namespace,
                field_selector=f"metadata.name={self._name}",
                resource_version=resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                _request_timeout=WATCH_TIMEOUT_S + _CLIENT_MARGIN_S,
            )
            async for event in stream:
                self._events += 1
                pod = event["object"]
                if not isinstance(pod, client.V1Pod) or pod.metadata is None:
                    continue  # a BOOKMARK carries no pod
                if pod.metadata.name != self._name:
                    continue
                if self._judged(judge_event(str(event["type"]), pod, self._uid), event["type"]):
                    return True
        return False

    def _judged(self, loss: Loss | None, seen: str) -> bool:
        if loss is None:
            return False
        self.reason, self.message = loss.reason, f"pod {self._name} ({seen}): {loss.message}"
        log.warning("sandbox lost: %s: %s", self.reason, self.message)
        self.lost.set()
        return True


# -- the pod-side quiesce before the bank (§7.3) --------------------------------------------------

QUIESCE_TAG = "runfleet-quiesce:"
_KEEP_PID = re.compile(r"\$\$|\$[A-Za-z_][A-Za-z0-9_]*|[0-9]+")

_QUIESCE = r"""
keep=@KEEP@; self=$$; round=0
quiesce_pass() {
  pending=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case $p in 1|"$keep"|"$self") continue ;; esac
    line=; read -r line 2>/dev/null < "$d/stat" || continue
    st=${line##*) }; st=${st%% *}
    case $st in T|t|Z|X|x|'') continue ;; esac
    pending=$((pending + 1))
    if [ "$1" = report ]; then
      comm=${line#*(}; comm=${comm%)*}
      echo "@TAG@ unstopped $p $st $comm" >&2
    else
      kill -s STOP "$p" 2>/dev/null
    fi
  done
}
if [ ! -r /proc/$self/stat ]; then echo "@TAG@ no-proc" >&2; else
  while [ $round -lt 10 ]; do
    quiesce_pass stop
    [ $pending = 0 ] && break
    round=$((round + 1))
    sleep 0.1 2>/dev/null || :
  done
  quiesce_pass report
  echo "@TAG@ done unstopped=$pending" >&2
fi
"""


def quiesce_script(keep_pid_var: str = "$$") -> str:
    """A POSIX sh fragment that SIGSTOPs every process it can see except PID 1, itself and
    `keep_pid_var`, then reports on stderr (`parse_quiesce_report`).

    With `shareProcessNamespace` the pod's processes are all in this `/proc`; without it, the
    container's are, which are the ones that can write the scratch. PID 1 is the pod's pause
    process or the container's idle entrypoint: the kernel does not deliver SIGSTOP to a
    namespace's init from inside, so it is never counted. Everything else not stopped after the
    rounds (another user's process, one stuck in uninterruptible I/O) is reported `unstopped`:
    the bank is then recorded `unquiesced`. Builtins only in the scan (no fork while scanning);
    `sleep` between rounds is best effort. Prefix a tar with it, `<script>; exec tar ...`, and
    `$$` is the tar: the quiesce keeps it by construction.
    """
    if not _KEEP_PID.fullmatch(keep_pid_var):
        raise ValueError(f"keep_pid_var must be $$, $NAME or a pid, not {keep_pid_var!r}")
    return _QUIESCE.replace("@KEEP@", keep_pid_var).replace("@TAG@", QUIESCE_TAG).strip()


def quiesce_command(keep_pid_var: str = "$$") -> list[str]:
    """The quiesce as an exec of its own: `sh -c <script>` (the tar runs after it)."""
    return ["sh", "-c", quiesce_script(keep_pid_var)]


@dataclass(frozen=True, slots=True)
class QuiesceReport:
    quiesced: bool
    """Every other process is stopped; False is recorded `unquiesced` (§7.3)."""
    unstopped: tuple[str, ...]
    """`<pid> <state> <comm>` of each process that could not be stopped."""
    detail: str


def parse_quiesce_report(stderr: str) -> QuiesceReport:
    """Read the quiesce's report; no `done` line (no `/proc`, no `sh`, cut short) is unquiesced."""
    unstopped: list[str] = []
    done: str | None = None
    for line in stderr.splitlines():
        if not line.startswith(QUIESCE_TAG):
            continue
        word, _, rest = line[len(QUIESCE_TAG) :].strip().partition(" ")
        if word == "unstopped":
            unstopped.append(rest)
        elif word == "done":
            done = rest
        elif word == "no-proc":
            return QuiesceReport(False, (), "no /proc to find the pod's processes in")
    if done is None:
        tail = stderr[-200:]
        return QuiesceReport(False, tuple(unstopped), f"the quiesce did not finish: {tail!r}")
    if unstopped:
        return QuiesceReport(False, tuple(unstopped), f"{len(unstopped)} process(es) not stopped")
    return QuiesceReport(True, (), "every other process stopped")
