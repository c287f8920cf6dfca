"""Executing one node of each kind (SPEC §6.1). A node returns a value or a failure code; it
never touches the checkpoint or the status (that is `execution.py`'s job at the boundary).

Nodes are at-least-once: a crash mid-node re-runs it on the next execution.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import inspect
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.attachments import AttachmentPathUnavailable
from engine.call_errors import AmbiguousEffect, Permanent, Transient
from engine.errors import ExpressionError, TemplateError
from engine.events import EventLog
from engine.expressions import evaluate
from engine.failures import FailureClass, FailureCode, rule_for
from engine.sandbox.protocols import Sandbox
from engine.templates import render
from engine.workflow import CallNode, ComputeNode, ToolNode


def template_failed(node_id: str, exc: TemplateError) -> NodeFailed:
    """A template that named an attachment the node cannot open fails with that code and the
    attachment named (SPEC §8), before the node runs; any other is `EXPRESSION_FAILED`."""
    cause = exc.__cause__
    if isinstance(cause, AttachmentPathUnavailable):
        return NodeFailed(FailureCode.ATTACHMENT_PATH_UNAVAILABLE, f"{node_id}: {cause}")
    return NodeFailed(FailureCode.EXPRESSION_FAILED, str(exc))


EXIT_TEMPFAIL = 75
"""EX_TEMPFAIL: a tool says "try me again" (TOOL_FAILED_TRANSIENT)."""

OUTPUT_CHUNK = 16 * 1024


@dataclass(frozen=True, slots=True)
class NodeOk:
    output: Any
    cost_usd: float = 0.0


@dataclass(frozen=True, slots=True)
class NodeFailed:
    code: str
    error: str
    cost_usd: float = 0.0


NodeResult = NodeOk | NodeFailed


@dataclass
class CallContext:
    """What a `call` node's function receives: who it runs for, and a way to report cost."""

    run_id: str
    node: str
    attempt: int
    vars: Mapping[str, Any]
    outputs: Mapping[str, Any]
    cost_usd: float = field(default=0.0)

    def report_cost(self, usd: float) -> None:
        # NaN passes every `<` check: it switched the cost cap off (a walkthrough).
        if isinstance(usd, bool) or not isinstance(usd, int | float) or not math.isfinite(usd):
            raise ValueError(f"report_cost takes a finite number of dollars, not {usd!r:.40}")
        if usd < 0:
            raise ValueError("cost cannot be negative")
        self.cost_usd += usd


SandboxProvider = Callable[[], Awaitable[Sandbox]]


async def run_compute(node: ComputeNode, scope: Mapping[str, Any]) -> NodeResult:
    try:
        values = {name: evaluate(expr, scope) for name, expr in node.set.items()}
    except ExpressionError as exc:
        return NodeFailed(FailureCode.EXPRESSION_FAILED, str(exc))
    for name, value in values.items():
        # A set, bytes, a complex number or NaN is a value an expression may hold but a
        # checkpoint cannot: it crashed `runfleet run` (`internal`) and, on a fleet, was a
        # status write refused again and again, read as a store outage (a walkthrough).
        not_json = _not_json(value)
        if not_json is not None:
            return NodeFailed(
                FailureCode.EXPRESSION_FAILED,
                f"set.{name} = {node.set[name]!r}: its value ({type(value).__name__}) cannot be"
                f" stored as JSON ({not_json}); give a number, a string, a bool, None, a list"
                " or a dict of those (a set as a list: [x for x in ...])",
            )
    return NodeOk(values)


async def run_tool(
    node_id: str,
    node: ToolNode,
    scope: Mapping[str, Any],
    sandbox: SandboxProvider,
    events: EventLog,
    output_cap: int,
    *,
    limit_name: str = "RUNFLEET_OUTPUT_CAP",
    events_max: int = 1024 * 1024,
) -> NodeResult:
    """Run a tool node's command. Its stdout is captured up to `output_cap`; the first stdout
    byte past it stops the command (the node fails `OUTPUT_TOO_LARGE`, which no try would
    change), and at most `events_max` bytes of its output become `node_output` events. A scale
    drill found neither bounded: a tool printing without end ran to its timeout, was retried,
    and wrote 2.4 GB of events into the store from one run."""
    try:
        command = render(node.run, scope, shell=True)
    except TemplateError as exc:
        return template_failed(node_id, exc)
    unrunnable = _unrunnable(node_id, command)
    if unrunnable is not None:
        return unrunnable
    box = await sandbox()
    captured = bytearray()
    pending: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    kept = 0
    not_kept = 0

    async def flush(stream: str) -> None:
        nonlocal kept, not_kept
        buf = pending[stream]
        if not buf:
            return
        room = max(0, events_max - kept)
        take, rest = bytes(buf[:room]), len(buf) - min(room, len(buf))
        buf.clear()
        not_kept += rest
        if take:
            kept += len(take)
            text = take.decode("utf-8", errors="replace")
            await events.emit("node_output", node=node_id, stream=stream, text=text)

    async def on_output(stream: str, chunk: bytes) -> None:
        if stream == "stdout":
            if len(captured) + len(chunk) > output_cap:
                raise _OutputOverflow
            captured.extend(chunk)
        pending[stream].extend(chunk)
        if len(pending[stream]) >= OUTPUT_CHUNK:
            await flush(stream)

    try:
        result = await box.exec(command, timeout_s=node.timeout, on_output=on_output)
    except _OutputOverflow:  # the sandbox stopped the command (`Sandbox.exec`'s contract)
        result = None
    await flush("stdout")
    await flush("stderr")
    if not_kept:
        await events.emit(
            "node_output",
            node=node_id,
            stream="stderr",
            text=f"[runfleet: {not_kept} more bytes of output were not kept as events"
            f" (RUNFLEET_OUTPUT_EVENTS_MAX={events_max})]",
            truncated=True,
        )
    if result is None:
        return NodeFailed(
            FailureCode.OUTPUT_TOO_LARGE,
            f"{node_id}: stdout exceeds {output_cap} bytes ({limit_name}); the command was"
            " stopped there",
        )
    if result.timed_out:
        return NodeFailed(FailureCode.TIMEOUT, f"{node_id}: timed out after {node.timeout:g}s")
    if result.exit_code == EXIT_TEMPFAIL:
        return NodeFailed(FailureCode.TOOL_FAILED_TRANSIENT, _tool_error(node_id, result))
    if result.exit_code != 0:
        return NodeFailed(FailureCode.TOOL_FAILED_PERMANENT, _tool_error(node_id, result))
    text = bytes(captured).decode("utf-8", errors="replace")
    if node.output == "json":
        try:
            return NodeOk(json.loads(text))
        except json.JSONDecodeError as exc:
            return NodeFailed(FailureCode.SCHEMA_VALIDATION, f"{node_id}: stdout not JSON: {exc}")
    return NodeOk(text.rstrip("\n"))


class _OutputOverflow(Exception):
    """Raised from the output callback: the sandbox stops the command."""


MAX_COMMAND_BYTES = 128 * 1024 - 1
"""Linux's `MAX_ARG_STRLEN` (32 pages) less the NUL: the longest one argument of `sh -c` may be."""


def _unrunnable(node_id: str, command: str) -> NodeFailed | None:
    """A command no `exec` can take fails its node for good, before a sandbox is asked: it was
    a `SandboxLost` (transient), retried and auto-resumed to the same end (found by a
    walkthrough: a var with a NUL byte, and one of 200 KB)."""
    if "\x00" in command:
        return NodeFailed(
            FailureCode.TOOL_FAILED_PERMANENT,
            f"{node_id}: the command holds a NUL byte (from a rendered value), which no command "
            "line can carry",
        )
    size = len(command.encode("utf-8", "surrogatepass"))
    if size > MAX_COMMAND_BYTES:
        return NodeFailed(
            FailureCode.TOOL_FAILED_PERMANENT,
            f"{node_id}: the rendered command is {size} bytes, over the {MAX_COMMAND_BYTES} one "
            "command line can carry; pass a large value as a file (an attachment, or a file "
            "an earlier node writes to the workspace or $RUNFLEET_SCRATCH_DIR)",
        )
    return None


def _tool_error(node_id: str, result: Any) -> str:
    tail = bytes(result.stderr_tail[-2000:]).decode("utf-8", errors="replace").strip()
    return f"{node_id}: exit {result.exit_code}" + (f": {tail}" if tail else "")


_OWN_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
"""A code of the callable's own: a fail node's form (`engine.workflow`)."""


def classed(code: object, *, transient: bool) -> str:
    """The failure code a `Transient` or `Permanent` leaves the node with. The exception's
    class says whether a retry may cure it, and the failure table must not say otherwise
    (found by review: `Permanent(RATE_LIMITED)` was retried and auto-resumed, and
    `Transient("QUOTA_HIT")`, a bot code, ended the run `failed` with no retry). A `Transient`
    keeps a transient engine code (a node's, or an infrastructure one such as
    `SANDBOX_CAPACITY` for a pool the callable fronts); a `Permanent` keeps a deterministic
    code or its own upper-case one, never one the engine keeps for budgets, the DLQ or a
    person. Anything else (an empty or malformed code too) becomes `EXECUTION_FAILED`
    (transient) or `TOOL_FAILED_PERMANENT` (terminal), and the error keeps the code the
    callable gave (found by a walkthrough: `Permanent("DLQ_PARKED")` faked a parked run,
    `Permanent("BUDGET_EXCEEDED")` paused one for a budget, `Permanent("")` left no code)."""
    fallback = FailureCode.EXECUTION_FAILED if transient else FailureCode.TOOL_FAILED_PERMANENT
    if not isinstance(code, str) or not _OWN_CODE.fullmatch(code):
        return fallback
    rule = rule_for(code)
    keeps = rule.transient if transient else rule.klass is FailureClass.DETERMINISTIC
    return code if keeps else fallback


async def run_call(
    node_id: str, node: CallNode, scope: Mapping[str, Any], ctx: CallContext
) -> NodeResult:
    try:
        inputs = {
            k: render(v, scope, shell=False) if isinstance(v, str) else v
            for k, v in node.inputs.items()
        }
        module_name, _, func_name = node.function.partition(":")
        fn = getattr(importlib.import_module(module_name), func_name)
    except TemplateError as exc:
        return template_failed(node_id, exc)
    except (ImportError, AttributeError) as exc:
        return NodeFailed(FailureCode.WORKFLOW_INVALID, f"{node_id}: {node.function}: {exc}")
    unusable = _unusable(fn)
    if unusable is not None:  # never cured by a retry: the file names the wrong thing
        return NodeFailed(FailureCode.WORKFLOW_INVALID, f"{node_id}: {node.function}: {unusable}")
    try:
        if inspect.iscoroutinefunction(fn):
            value = await fn(ctx, inputs)
        else:
            # A plain function runs on a thread of its own: blocking code in it (`time.sleep`, a
            # blocking client) would otherwise stall the runner's loop, its lease refreshes and
            # every other run on it (found by a walkthrough: leases lost, the call run again).
            # It runs in a copy of the caller's context, as `asyncio.to_thread` does: a tracing
            # span or a context variable the runner set is what the function sees (the thread
            # saw none, and the protocol model's checks of a node's start were skipped).
            loop = asyncio.get_running_loop()
            call = functools.partial(contextvars.copy_context().run, fn, ctx, inputs)
            value = await loop.run_in_executor(_call_threads(), call)
            if inspect.isawaitable(value):
                value = await value
    except (Transient, Permanent) as exc:
        code = classed(exc.code, transient=isinstance(exc, Transient))
        named = "" if code == exc.code else f"{_shown(exc.code)}: "
        return NodeFailed(code, f"{node_id}: {named}{_text(exc)}", ctx.cost_usd)
    except AmbiguousEffect as exc:
        return NodeFailed(FailureCode.AMBIGUOUS_EFFECT, f"{node_id}: {_text(exc)}", ctx.cost_usd)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the timeout's or a cancel's: not the callable's own
        return NodeFailed(
            FailureCode.EXECUTION_FAILED,
            f"{node_id}: the call raised CancelledError without being cancelled",
            ctx.cost_usd,
        )
    except BaseException as exc:  # noqa: BLE001 - user code's error, SystemExit too: the runner serves on
        return NodeFailed(
            FailureCode.EXECUTION_FAILED, f"{node_id}: {_described(exc)}", ctx.cost_usd
        )
    if value is not None and not isinstance(value, dict):
        return NodeFailed(
            FailureCode.SCHEMA_VALIDATION, f"{node_id}: a call must return a dict", ctx.cost_usd
        )
    not_json = _not_json(value)
    if not_json is not None:  # it was a status write refused again and again (a walkthrough)
        return NodeFailed(
            FailureCode.SCHEMA_VALIDATION,
            f"{node_id}: the call's result cannot be stored as JSON: {not_json}",
            ctx.cost_usd,
        )
    return NodeOk(value or {}, ctx.cost_usd)


CALL_THREADS = 64
"""Threads for plain-function calls: many, since a call past its timeout keeps its thread
until it returns (a thread cannot be stopped); its own pool, so such calls never take the
threads the stores and blob stores use."""
_CALL_POOL: list[ThreadPoolExecutor] = []


def _call_threads() -> ThreadPoolExecutor:
    if not _CALL_POOL:
        _CALL_POOL.append(
            ThreadPoolExecutor(max_workers=CALL_THREADS, thread_name_prefix="runfleet-call")
        )
    return _CALL_POOL[0]


def _unusable(fn: object) -> str | None:
    """Why `fn` cannot be called as `fn(ctx, inputs)`, or None."""
    if not callable(fn):
        return f"is a {type(fn).__name__}, not a function"
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        return f"cannot be called as fn(ctx, inputs): {exc}"
    except ValueError:  # no signature to read (a builtin): let the call say
        return None
    return None


def _text(exc: BaseException) -> str:
    """`str(exc)`, even when the exception's own `__str__` fails."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - user code's `__str__`
        return f"<{type(exc).__name__} whose message cannot be shown>"


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_text(exc)}"


def _shown(code: object) -> str:
    return code if isinstance(code, str) and code.isprintable() and code else repr(code)[:80]


def _not_json(value: Any) -> str | None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return str(exc)[:300]
    except RecursionError:
        return "nested too deeply"
    return None
