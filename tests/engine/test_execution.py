"""Executions end to end on a real store and a real local sandbox (SPEC §5.3 Local, §5.4, §6).

Each test drives `run_local` / `resume_local` (or an `Execution` by hand where it needs the
cancel signal) and judges the run document and its events. Tool nodes append their name to a
ledger file, so "ran exactly once" is read from what the sandbox actually did, not from the
engine's own account of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from engine.cancel import CancelSignal
from engine.config import EngineSettings
from engine.execution import Execution
from engine.failures import FailureCode
from engine.loader import LoadedWorkflow, load_workflow
from engine.local import LocalEnv, resume_local, run_local
from engine.outcome import CancelReason, Interrupted
from engine.refusals import SourceLacksRestartNode
from engine.resume import ResumeRequest
from engine.sandbox.local import LocalSandbox, LocalSandboxDriver
from engine.sandbox.protocols import SandboxSpec
from engine.settle import settle
from store import (
    Budget,
    Eq,
    Event,
    RunDocument,
    RunQuery,
    RunStatus,
    RunStore,
    Update,
    lease_is_free,
    utcnow,
)
from store.sqlite import SqliteRunStore
from tests.engine import callables

Load = Callable[[str], LoadedWorkflow]
Events = Callable[[str], Awaitable[list[Event]]]
Poll = Callable[..., Awaitable[Any]]
Claim = Callable[..., Awaitable[tuple[RunDocument, str]]]

RUNFLEET = Path(sys.executable).parent / "runfleet"
DEADLINE_S = 15.0


def ledger_lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def started(events: list[Event], node: str) -> int:
    return sum(1 for e in events if e.type == "node_started" and e.data.get("node") == node)


def of_type(events: list[Event], type_: str) -> list[Event]:
    return [e for e in events if e.type == type_]


class CountingDriver(LocalSandboxDriver):
    """The real local driver, counting the sandboxes it starts."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.starts = 0

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        self.starts += 1
        return await super().start(spec)


# -- §13.6: a resume never re-executes a completed node ---------------------------------------


async def test_resume_reexecutes_the_restart_node_and_never_a_completed_node(
    env: LocalEnv, load: Load, events: Events, tmp_path: Path
) -> None:
    ledger, gate = tmp_path / "ledger", tmp_path / "gate"
    inputs = {"ledger": str(ledger), "gate": str(gate)}

    failed = await run_local(env, load("ledger"), inputs)

    assert failed.status is RunStatus.FAILED_RESUMABLE
    assert failed.failure_code == FailureCode.TOOL_FAILED_TRANSIENT
    assert failed.checkpoint is not None
    assert failed.checkpoint.restart_node == "b"
    assert failed.checkpoint.completed == ["a"]
    assert ledger_lines(ledger) == ["a", "b"]

    gate.touch()
    done = await resume_local(env, failed.run_id, ResumeRequest())

    assert done.status is RunStatus.FINISHED
    assert done.attempt == 2
    assert ledger_lines(ledger) == ["a", "b", "b", "c"]
    log = await events(done.run_id)
    assert started(log, "a") == 1
    assert started(log, "b") == 2
    resumed_at = of_type(log, "run_resumed")[0].seq
    first_after = next(e for e in log if e.seq > resumed_at and e.type == "node_started")
    assert first_after.data["node"] == "b"


async def test_answers_select_the_outgoing_edge_and_the_human_node_is_not_asked_again(
    env: LocalEnv, load: Load, events: Events
) -> None:
    paused = await run_local(env, load("examples/approval"), {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN

    done = await resume_local(
        env, paused.run_id, ResumeRequest(cli_answers={"approved": "no", "note": "later"})
    )

    assert done.status is RunStatus.FINISHED
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["review"] == {"approved": False, "note": "later"}
    assert done.checkpoint.outputs["rejected"] == {"decision": "rejected", "note": "later"}
    assert "accepted" not in done.checkpoint.outputs
    log = await events(done.run_id)
    assert started(log, "prepare") == 1
    assert len(of_type(log, "human_input_requested")) == 1
    assert [e.data["node"] for e in of_type(log, "human_answers_recorded")] == ["review"]


APPROVAL_LOOP = """
name: approve_loop
entry: ask
budget: {max_iterations: 1}
nodes:
  ask: {kind: human, questions: [{name: ok, type: bool}]}
  work: {kind: compute, set: {n: "answers.ok"}}
edges:
  - {from: ask, to: work}
  - {from: work, to: ask, loop: {name: l, max: 3}}
"""


async def test_a_question_reached_again_in_a_loop_is_asked_again_after_a_stop_before_it(
    env: LocalEnv, events: Events
) -> None:
    """Found by review: round 1's answers stayed as the question's output, so a stop on the
    way back to it (here the iteration cap; a cancel, a drain or a crash alike) resumed into
    "answered": `work` ran again on round 1's answer and round 2 was never asked."""
    loaded = load_workflow(APPROVAL_LOOP, "approve_loop.yaml")
    paused = await run_local(env, loaded, {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN
    parked = await resume_local(env, paused.run_id, ResumeRequest(cli_answers={"ok": "yes"}))
    assert parked.status is RunStatus.PAUSED_OPERATOR  # the cap, at `ask`, before round 2
    assert parked.checkpoint is not None and parked.checkpoint.restart_node == "ask"
    assert "ask" not in parked.checkpoint.outputs

    again = await resume_local(env, parked.run_id, ResumeRequest(budget=Budget(max_iterations=10)))

    assert again.status is RunStatus.PAUSED_WAITING_HUMAN  # round 2 asks
    log = await events(again.run_id)
    assert len(of_type(log, "human_input_requested")) == 2
    assert len(of_type(log, "human_answers_recorded")) == 1
    assert started(log, "work") == 1


CAPPED_AT_B = """
name: w
entry: a
budget: {max_iterations: 1}
nodes:
  a: {kind: compute, set: {x: "1"}}
  b: {kind: compute, set: {y: "2"}}
edges:
  - {from: a, to: b}
"""
ASKS_AT_B = """
name: w
entry: a
nodes:
  a: {kind: compute, set: {x: "1"}}
  b: {kind: human, questions: [{name: ok, type: bool}]}
edges:
  - {from: a, to: b}
"""
WITHOUT_B = """
name: w
entry: a
nodes:
  a: {kind: compute, set: {x: "1"}}
  c: {kind: compute, set: {z: "3"}}
edges:
  - {from: a, to: c}
"""


async def test_a_forced_source_without_the_node_the_run_restarts_at_is_refused_typed(
    env: LocalEnv,
) -> None:
    """Found by review: the swap was accepted and the claim crashed on the missing node
    (`KeyError`), leaving the run `running` with the new source swapped in; in the fleet an
    INTERNAL_ERROR, retried until the DLQ. Now refused before anything is written."""
    for source, answers, budget in (
        (CAPPED_AT_B, {}, Budget(max_iterations=10)),
        (ASKS_AT_B, {"ok": "yes"}, None),
    ):
        stopped = await run_local(env, load_workflow(source, "old.yaml"), {})
        assert stopped.checkpoint is not None and stopped.checkpoint.restart_node == "b"
        request = ResumeRequest(
            cli_answers=answers,
            budget=budget,
            new_source=load_workflow(WITHOUT_B, "new.yaml"),
            force=True,
        )
        with pytest.raises(SourceLacksRestartNode) as info:
            await resume_local(env, stopped.run_id, request)
        assert info.value.code == "source_lacks_restart_node"
        assert "'b'" in info.value.message
        unchanged = await env.store.get_run(stopped.run_id)
        assert unchanged.status is stopped.status
        assert unchanged.workflow.source_hash == stopped.workflow.source_hash


# -- §6.2: nodes are at-least-once; a crash re-runs only the node it interrupted --------------


def _cli_env(data: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    return {
        **base,
        "RUNFLEET_DATA": str(data),
        "RUNFLEET_LEASE_TTL": "3s",
        "RUNFLEET_LEASE_INTERVAL": "1s",
        "RUNFLEET_LEASE_SKEW": "0.5s",
    }


async def test_crash_mid_node_reruns_only_that_node(tmp_path: Path, poll: Poll) -> None:
    data = tmp_path / "data"
    ledger, marker, release = tmp_path / "ledger", tmp_path / "marker", tmp_path / "release"
    workflow_file = Path(__file__).parent / "workflows" / "crash.yaml"
    cli_env = _cli_env(data)
    run_args = [
        *("run", str(workflow_file), "--json", "--quiet"),
        *("--var", f"ledger={ledger}", "--var", f"marker={marker}"),
        *("--var", f"release={release}"),
    ]
    proc = await asyncio.create_subprocess_exec(
        str(RUNFLEET),
        *run_args,
        env=cli_env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await poll(
            lambda: asyncio.sleep(0, marker.exists()),
            bool,
            within=DEADLINE_S,
            what="the second node's marker",
        )
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ledger_lines(ledger) == ["first", "second"]

    store = await SqliteRunStore.open(data / "runs.db")
    try:
        (crashed,) = (await store.list_runs(RunQuery())).runs
        assert crashed.status is RunStatus.RUNNING
        assert crashed.checkpoint is not None
        assert crashed.checkpoint.restart_node == "second"
        assert crashed.checkpoint.completed == ["first"]
        skew = timedelta(seconds=0.5)
        await poll(
            lambda: store.get_run(crashed.run_id),
            lambda doc: lease_is_free(doc, utcnow(), skew),
            within=DEADLINE_S,
            what="the crashed execution's lease to expire",
        )

        release.touch()
        resume = await asyncio.create_subprocess_exec(
            str(RUNFLEET),
            *("resume", crashed.run_id, "--local", "--json", "--quiet"),
            env=cli_env,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(resume.communicate(), DEADLINE_S * 2)
        assert resume.returncode == 0, (out.decode(), err.decode())
        view = json.loads(out)
        assert view["status"] == "finished", view

        assert ledger_lines(ledger) == ["first", "second", "second", "third"]
        log = await store.read_events(crashed.run_id, limit=10_000)
        assert started(log, "first") == 1
        assert started(log, "second") == 2
        assert [e.data["from_status"] for e in of_type(log, "run_resumed")] == ["running"]
        final = await store.get_run(crashed.run_id)
        assert final.attempt == 2
        assert final.lease is None
    finally:
        await store.close()


# -- §6.4: the budget preflight ----------------------------------------------------------------


RETRIES_PAST_THE_CAP = """
name: costly
entry: c
budget: {max_iterations: 2}
nodes:
  c:
    kind: call
    function: "tests.engine.callables:flaky"
    inputs: {failures: 10}
    retry: {max: 5, backoff: 0.001}
"""


async def test_a_node_retry_that_the_budget_cannot_pay_for_pauses_for_the_budget(
    env: LocalEnv, events: Events
) -> None:
    """Found by review: in-process retries never looked at the budget, so a node declaring
    5 retries spent 6 iterations under a cap of 2. The retry due after the cap is reached
    pauses the run for its budget at the node, as the walk does between nodes (SPEC §6.4)."""
    parked = await run_local(env, load_workflow(RETRIES_PAST_THE_CAP, "costly.yaml"), {})

    assert parked.status is RunStatus.PAUSED_OPERATOR
    assert parked.failure_code == FailureCode.BUDGET_EXCEEDED
    assert parked.checkpoint is not None and parked.checkpoint.restart_node == "c"
    assert parked.checkpoint.usage.iterations == 2
    assert callables.calls[parked.run_id] == 2
    failed = [e.data["retry"] for e in of_type(await events(parked.run_id), "node_failed")]
    assert failed == [True, False]


def _one_call(function: str) -> str:
    return (
        "name: one_call\nentry: c\nnodes:\n"
        f"  c: {{kind: call, function: 'tests.engine.callables:{function}',"
        " retry: {max: 3, backoff: 0.001}}\n"
    )


async def test_a_permanent_call_failure_ends_the_run_failed_whatever_its_code(
    env: LocalEnv,
) -> None:
    """Found by review: `Permanent(RATE_LIMITED)` was retried in process and parked
    `failed_resumable`, auto-resumable, because the failure table alone decided."""
    done = await run_local(env, load_workflow(_one_call("permanent_rate_limited"), "p.yaml"), {})

    assert done.status is RunStatus.FAILED
    assert done.failure_code == FailureCode.TOOL_FAILED_PERMANENT
    assert done.error is not None and "RATE_LIMITED" in done.error
    assert callables.calls[done.run_id] == 1


async def test_a_transient_call_failure_is_retried_whatever_its_code(env: LocalEnv) -> None:
    """The other half: `Transient("QUOTA_HIT")`, a bot code, ended the run `failed` with no
    retry. It is retried as the transient failure its class says it is."""
    done = await run_local(env, load_workflow(_one_call("transient_bot_code"), "t.yaml"), {})

    assert done.status is RunStatus.FINISHED
    assert callables.calls[done.run_id] == 2


async def test_budget_exhausted_resume_without_raised_cap_reparks_paused_operator_without_starting_a_sandbox(  # noqa: E501
    store: RunStore, load: Load, events: Events, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    first_driver = CountingDriver(tmp_path)
    first_env = LocalEnv(store, first_driver, EngineSettings(), tmp_path)

    parked = await run_local(first_env, load("budget_tools"), {"ledger": str(ledger)})

    assert parked.status is RunStatus.PAUSED_OPERATOR
    assert parked.failure_code == FailureCode.BUDGET_EXCEEDED
    assert parked.checkpoint is not None
    assert parked.checkpoint.restart_node == "c"
    assert parked.checkpoint.usage.iterations == 2
    assert first_driver.starts == 1
    assert ledger_lines(ledger) == ["a", "b"]
    usage_before = parked.checkpoint.usage

    driver = CountingDriver(tmp_path)
    again = await resume_local(
        LocalEnv(store, driver, EngineSettings(), tmp_path), parked.run_id, ResumeRequest()
    )

    assert again.status is RunStatus.PAUSED_OPERATOR
    assert again.failure_code == FailureCode.BUDGET_EXCEEDED
    assert again.attempt == parked.attempt + 1
    assert driver.starts == 0
    assert ledger_lines(ledger) == ["a", "b"]
    assert again.checkpoint is not None
    assert again.checkpoint.restart_node == "c"
    assert again.checkpoint.usage.iterations == usage_before.iterations
    assert again.checkpoint.usage.elapsed >= usage_before.elapsed
    assert again.checkpoint.usage.cost_usd >= usage_before.cost_usd
    assert again.budget.max_iterations == 2
    log = await events(parked.run_id)
    assert started(log, "c") == 0
    assert of_type(log, "sandbox_started")[-1].seq < of_type(log, "run_resumed")[0].seq
    assert [e.data["kind"] for e in of_type(log, "run_paused")] == ["budget", "budget"]


# -- §6.5: resumable fail nodes ----------------------------------------------------------------


async def test_resumable_fail_anchors_on_its_guard_and_a_raised_cap_takes_the_other_edge(
    env: LocalEnv, load: Load, events: Events
) -> None:
    parked = await run_local(env, load("examples/budget_guard"), {})

    assert parked.status is RunStatus.FAILED_RESUMABLE
    assert parked.failure_code == "BUDGET_GUARD"
    assert parked.checkpoint is not None
    assert parked.checkpoint.restart_node == "check"

    done = await resume_local(env, parked.run_id, ResumeRequest(budget=Budget(max_iterations=20)))

    assert done.status is RunStatus.FINISHED, (done.failure_code, done.error)
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["done"] == {"total": 4}
    assert done.budget.max_iterations == 20
    assert done.checkpoint.usage.iterations > parked.checkpoint.usage.iterations
    log = await events(done.run_id)
    resumed_at = of_type(log, "run_resumed")[0].seq
    first_after = next(e for e in log if e.seq > resumed_at and e.type == "node_started")
    assert first_after.data["node"] == "check"


async def test_fail_node_reached_from_two_predecessors_ends_failed_with_the_warning(
    env: LocalEnv, load: Load, events: Events
) -> None:
    doc = await run_local(env, load("two_predecessors_fail"), {})

    assert doc.status is RunStatus.FAILED
    assert doc.failure_code == "NO_GUARD"
    assert doc.error == "stopped after left"
    (failed,) = of_type(await events(doc.run_id), "run_failed")
    assert failed.data["code"] == "NO_GUARD"
    assert "predecessors" in failed.data["warning"]


async def test_a_resumable_fail_node_that_is_the_entry_ends_failed_with_the_warning(
    env: LocalEnv, load: Load, events: Events
) -> None:
    """Found by review: a resumable fail node at the entry anchored the run on its one
    predecessor, a node the run never reached, and parked it for a resume that would start
    there. No guard leads to the entry, so the run ends `failed` (`Workflow.guard_of`)."""
    doc = await run_local(env, load("entry_fail"), {})

    assert doc.status is RunStatus.FAILED
    assert doc.failure_code == "NO_GUARD"
    assert doc.checkpoint is not None and doc.checkpoint.restart_node == "stop"
    (failed,) = of_type(await events(doc.run_id), "run_failed")
    assert "is the entry" in failed.data["warning"]


# -- §6.6: in-process node retries -------------------------------------------------------------


async def test_a_transient_call_failure_is_retried_in_process_until_it_succeeds(
    env: LocalEnv, load: Load, events: Events
) -> None:
    doc = await run_local(env, load("retry_flaky"), {"failures": 2})

    assert doc.status is RunStatus.FINISHED, (doc.failure_code, doc.error)
    assert callables.calls[doc.run_id] == 3
    assert doc.checkpoint is not None
    assert doc.checkpoint.outputs["after"] == {"calls": 3}
    assert doc.checkpoint.node_retries == {}
    failures = of_type(await events(doc.run_id), "node_failed")
    assert [(e.data["code"], e.data["retry"]) for e in failures] == [
        (FailureCode.RATE_LIMITED, True),
        (FailureCode.RATE_LIMITED, True),
    ]


async def test_a_transient_failure_past_the_node_retries_parks_failed_resumable(
    env: LocalEnv, load: Load, events: Events
) -> None:
    doc = await run_local(env, load("retry_flaky"), {"failures": 3})

    assert doc.status is RunStatus.FAILED_RESUMABLE
    assert doc.failure_code == FailureCode.RATE_LIMITED
    assert callables.calls[doc.run_id] == 3
    assert doc.checkpoint is not None
    assert doc.checkpoint.restart_node == "flaky"
    failures = of_type(await events(doc.run_id), "node_failed")
    assert [e.data["retry"] for e in failures] == [True, True, False]


async def test_a_deterministic_failure_is_never_retried_in_process(
    env: LocalEnv, load: Load, events: Events
) -> None:
    doc = await run_local(env, load("retry_broken"), {})

    assert doc.status is RunStatus.FAILED
    assert doc.failure_code == FailureCode.TOOL_FAILED_PERMANENT
    assert callables.calls[doc.run_id] == 1
    (failure,) = of_type(await events(doc.run_id), "node_failed")
    assert failure.data["retry"] is False
    assert failure.data["code"] == FailureCode.TOOL_FAILED_PERMANENT


# -- §5.8: operator cancel and drain -----------------------------------------------------------


async def test_operator_cancel_read_at_a_lease_refresh_ends_the_run_cancelled_at_the_node(
    store: RunStore,
    load: Load,
    events: Events,
    poll: Poll,
    tmp_path: Path,
    fast_lease: EngineSettings,
) -> None:
    seen: list[Event] = []
    env = LocalEnv(store, LocalSandboxDriver(tmp_path), fast_lease, tmp_path, on_event=seen.append)
    task = asyncio.ensure_future(run_local(env, load("gate"), {}))
    try:
        await poll(
            lambda: asyncio.sleep(0, seen),
            lambda log: started(log, "hold") == 1,
            within=DEADLINE_S,
            what="node hold to start",
        )
        run_id = seen[0].run_id
        await asyncio.wait_for(callables.gate(run_id).entered.wait(), DEADLINE_S)

        asked = await store.update_run(
            run_id, [Eq("status", RunStatus.RUNNING)], Update(set={"cancel_requested": True})
        )
        assert isinstance(asked, RunDocument)
        doc = await asyncio.wait_for(task, DEADLINE_S)
    finally:
        task.cancel()

    assert doc.status is RunStatus.CANCELLED
    assert doc.cancel_requested is False
    assert doc.lease is None
    assert doc.checkpoint is not None
    assert doc.checkpoint.restart_node == "hold"
    assert "before" in doc.checkpoint.outputs
    assert "hold" not in doc.checkpoint.outputs
    assert not callables.gate(run_id).release.is_set()
    # the call itself was cancelled, not left running behind the cancelled run
    await asyncio.wait_for(callables.gate(run_id).cancelled.wait(), DEADLINE_S)
    log = await events(run_id)
    assert len(of_type(log, "run_cancelled")) == 1
    assert not [e for e in of_type(log, "node_finished") if e.data["node"] == "hold"]


async def test_drain_interrupts_the_execution_and_never_cancels_the_run(
    store: RunStore, load: Load, events: Events, claim: Claim, tmp_path: Path
) -> None:
    run, token = await claim(load("gate"))
    cancel = CancelSignal()
    execution = Execution(
        store=store,
        run=run,
        token=token,
        driver=LocalSandboxDriver(tmp_path),
        settings=EngineSettings(),
        cancel=cancel,
        data_dir=tmp_path,
    )
    task = asyncio.ensure_future(execution.run())
    try:
        await asyncio.wait_for(callables.gate(run.run_id).entered.wait(), DEADLINE_S)
        cancel.cancel(CancelReason.DRAIN)
        outcome = await asyncio.wait_for(task, DEADLINE_S)
    finally:
        task.cancel()

    assert outcome == Interrupted(CancelReason.DRAIN)
    settled = await settle(execution.writer, execution.events, outcome)
    await execution.teardown()
    await execution.writer.release()

    assert settled is not None
    assert settled.status is RunStatus.FAILED_RESUMABLE
    assert settled.failure_code == FailureCode.RUNNER_INTERRUPTED
    assert settled.checkpoint is not None
    assert settled.checkpoint.restart_node == "hold"
    log = await events(run.run_id)
    assert of_type(log, "run_cancelled") == []
    assert [e.data["code"] for e in of_type(log, "run_failed")] == [FailureCode.RUNNER_INTERRUPTED]
