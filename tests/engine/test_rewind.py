"""Rewind (SPEC §6.7): which outputs it drops, the one CAS that parks the run, and its refusals.

The graph rule is checked on a table of small workflows loaded from YAML text; the rest runs real
workflows to a rewindable status on each store and rewinds them.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta

import pytest

from engine.loader import LoadedWorkflow, load_workflow
from engine.local import LocalEnv, resume_local, run_local
from engine.refusals import RewindRefused, RunBusy
from engine.resume import ResumeRequest
from engine.rewind import dropped_by_rewind, rewind
from store import (
    Checkpoint,
    Eq,
    Event,
    Lease,
    ResumeSpec,
    RunDocument,
    RunStatus,
    RunStore,
    Update,
    WorkflowRef,
    utcnow,
)

Load = Callable[[str], LoadedWorkflow]
Events = Callable[[str], Awaitable[list[Event]]]


def graph(edges: str, entry: str = "a") -> LoadedWorkflow:
    """A workflow of compute nodes wired by `edges`, e.g. "a>b b>c c>b"."""
    pairs = [tuple(e.split(">")) for e in edges.split()]
    nodes = sorted({n for pair in pairs for n in pair} | {entry})
    text = [f"name: g\nentry: {entry}\nnodes:"]
    text += [f"  {n}:\n    kind: compute\n    set:\n      v: \"'{n}'\"" for n in nodes]
    text += ["edges:"] + [f"  - from: {src}\n    to: {dst}" for src, dst in pairs]
    return load_workflow("\n".join(text) + "\n", "graph.yaml")


@pytest.mark.parametrize(
    ("edges", "target", "dropped"),
    [
        pytest.param("a>b b>c c>d", "a", "abcd", id="chain-from-entry"),
        pytest.param("a>b b>c c>d", "b", "bcd", id="chain-middle"),
        pytest.param("a>b b>c c>d", "d", "d", id="chain-last"),
        pytest.param("a>b a>c b>d c>d", "a", "abcd", id="diamond-top"),
        pytest.param("a>b a>c b>d c>d", "b", "bd", id="diamond-side"),
        pytest.param("a>b a>c b>d c>d", "d", "d", id="diamond-join"),
        pytest.param("a>b b>c c>b c>d", "a", "abcd", id="loop-before-it"),
        pytest.param("a>b b>c c>b c>d", "b", "bd", id="loop-head"),
        pytest.param("a>b b>c c>b c>d", "c", "cd", id="loop-tail"),
        pytest.param("a>b b>c c>b c>d", "d", "d", id="loop-exit"),
        pytest.param("a>b b>c c>d d>b d>e e>f", "c", "cef", id="loop-target-inside"),
        pytest.param("a>b a>c b>d", "b", "bd", id="branch-not-taken-kept"),
        pytest.param("a>b a>c b>d", "c", "c", id="branch-alone"),
        pytest.param("a>a a>b", "a", "ab", id="self-loop"),
        pytest.param("a>b b>c c>b c>a c>d", "b", "bd", id="nested-loops"),
    ],
)
def test_rewind_drops_exactly_the_forward_reachable_non_ancestors(
    edges: str, target: str, dropped: str
) -> None:
    assert dropped_by_rewind(graph(edges).workflow, target) == set(dropped)


# -- end to end --------------------------------------------------------------------------------


async def test_rewind_parks_paused_operator_in_one_cas_keeping_counters_and_usage(
    env: LocalEnv, store: RunStore, load: Load, events: Events
) -> None:
    failed = await run_local(env, load("rewind_loop"), {})
    assert failed.status is RunStatus.FAILED
    assert failed.failure_code == "STOP_HERE"
    cp = failed.checkpoint
    assert cp is not None
    assert cp.loop_counters == {"again": 2}

    result = await rewind(store, failed.run_id, "body")

    doc = result.run
    assert doc == await store.get_run(failed.run_id)
    assert doc.version == failed.version + 1
    assert doc.status is RunStatus.PAUSED_OPERATOR
    assert doc.failure_code is None
    assert doc.error is None
    assert doc.attempt == failed.attempt
    assert result.dropped == ["body", "stop"]
    assert doc.checkpoint is not None
    assert doc.checkpoint.restart_node == "body"
    assert doc.checkpoint.outputs == {"start": cp.outputs["start"], "check": cp.outputs["check"]}
    assert "body" not in doc.checkpoint.completed
    assert doc.checkpoint.loop_counters == cp.loop_counters
    assert doc.checkpoint.usage == cp.usage
    (rewound,) = [e for e in await events(failed.run_id) if e.type == "run_rewound"]
    assert rewound.data == {
        "from_node": "stop",
        "to_node": "body",
        "dropped_nodes": ["body", "stop"],
        "source_changed": False,
        "discarded_attempt": None,
    }


async def test_a_rewound_run_continues_only_through_an_explicit_resume_from_the_node(
    env: LocalEnv, store: RunStore, load: Load, events: Events
) -> None:
    failed = await run_local(env, load("rewind_loop"), {})
    await rewind(store, failed.run_id, "check")
    assert (await store.get_run(failed.run_id)).status is RunStatus.PAUSED_OPERATOR
    before = len(await events(failed.run_id))

    resumed = await resume_local(env, failed.run_id, ResumeRequest())

    log = (await events(failed.run_id))[before:]
    started = [e.data["node"] for e in log if e.type == "node_started"]
    assert started[0] == "check"
    assert "start" not in started
    assert resumed.status is RunStatus.FAILED
    assert resumed.checkpoint is not None
    before_usage = (failed.checkpoint or Checkpoint()).usage
    assert resumed.checkpoint.usage.iterations > before_usage.iterations


async def test_rewind_of_a_waiting_run_retires_its_pending_interaction(
    env: LocalEnv, store: RunStore, load: Load
) -> None:
    paused = await run_local(env, load("examples/approval"), {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN
    assert len(await store.list_interactions(paused.run_id, pending_only=True)) == 1

    result = await rewind(store, paused.run_id, "prepare")

    assert result.run.status is RunStatus.PAUSED_OPERATOR
    assert result.run.checkpoint is not None
    assert result.run.checkpoint.pending_interaction is None
    assert result.run.checkpoint.outputs == {}
    assert await store.list_interactions(paused.run_id, pending_only=True) == []


async def test_rewind_of_a_queued_run_discards_its_resume_request(
    env: LocalEnv, store: RunStore, load: Load, events: Events
) -> None:
    parked = await run_local(env, load("examples/budget_guard"), {})
    assert parked.status is RunStatus.FAILED_RESUMABLE
    # A resume was accepted (status and attempt read, SPEC §2) but no claim took it yet.
    queued = await store.update_run(
        parked.run_id,
        [Eq("status", RunStatus.FAILED_RESUMABLE), Eq("attempt", parked.attempt)],
        Update(
            set={
                "status": RunStatus.QUEUED,
                "attempt": parked.attempt + 1,
                "resume_spec": ResumeSpec(
                    attempt=parked.attempt + 1, prior_status=RunStatus.FAILED_RESUMABLE
                ).model_dump(),
            }
        ),
    )
    assert isinstance(queued, RunDocument)
    assert queued.resume_spec is not None

    result = await rewind(store, parked.run_id, "step")

    assert result.run.status is RunStatus.PAUSED_OPERATOR
    assert result.run.resume_spec is None
    assert result.run.attempt == queued.attempt
    assert result.run.version == queued.version + 1
    (rewound,) = [e for e in await events(parked.run_id) if e.type == "run_rewound"]
    assert rewound.data["discarded_attempt"] == queued.attempt


LOOP_EDGE = """\
  - from: check
    to: body
    when: not outputs.check.done
    loop:
      name: again
      max: 5
"""


async def test_rewind_with_a_new_source_drops_by_the_new_graph_and_stores_it_in_the_same_cas(
    env: LocalEnv, store: RunStore, load: Load
) -> None:
    old = load("rewind_loop")
    failed = await run_local(env, old, {})
    assert LOOP_EDGE in old.source
    new = load_workflow(old.source.replace(LOOP_EDGE, ""), "rewind_loop_no_loop.yaml")

    result = await rewind(store, failed.run_id, "body", new_source=new)

    # Without the loop edge `check` can no longer reach `body` back, so it is dropped too.
    assert result.dropped == ["body", "check", "stop"]
    assert result.run.version == failed.version + 1
    assert result.run.workflow.source == new.source
    assert result.run.workflow.source_hash == new.source_hash
    assert result.run.checkpoint is not None
    assert set(result.run.checkpoint.outputs) == {"start"}


# -- refusals ----------------------------------------------------------------------------------


async def _refused(store: RunStore, run_id: str, node: str, kind: type[Exception]) -> None:
    """The rewind is refused with `kind` and writes nothing: no document change, no event."""
    before = await store.get_run(run_id)
    events_before = await store.read_events(run_id, limit=100_000)
    with pytest.raises(kind):
        await rewind(store, run_id, node)
    assert await store.get_run(run_id) == before
    assert await store.read_events(run_id, limit=100_000) == events_before


async def test_rewind_to_an_unknown_node_is_refused(
    env: LocalEnv, store: RunStore, load: Load
) -> None:
    failed = await run_local(env, load("rewind_loop"), {})
    await _refused(store, failed.run_id, "nowhere", RewindRefused)


async def test_rewind_to_a_node_the_run_never_reached_is_refused(
    env: LocalEnv, store: RunStore, load: Load
) -> None:
    paused = await run_local(env, load("examples/approval"), {})
    assert paused.status is RunStatus.PAUSED_WAITING_HUMAN
    await _refused(store, paused.run_id, "rejected", RewindRefused)


async def test_rewind_of_a_run_without_a_checkpoint_is_refused(store: RunStore, load: Load) -> None:
    loaded = load("rewind_loop")
    now = utcnow()
    run = await store.create_run(
        RunDocument(
            run_id=str(uuid.uuid4()),
            workflow=WorkflowRef(
                name=loaded.workflow.name, source=loaded.source, source_hash=loaded.source_hash
            ),
            status=RunStatus.QUEUED,
            attempt_at=now,
            created_at=now,
            updated_at=now,
        )
    )
    await _refused(store, run.run_id, "start", RewindRefused)


async def test_rewind_while_the_lease_is_held_answers_run_busy(
    env: LocalEnv, store: RunStore, load: Load
) -> None:
    failed = await run_local(env, load("rewind_loop"), {})
    held = await store.update_run(
        failed.run_id,
        [Eq("status", RunStatus.FAILED)],
        Update(
            set={
                "lease": Lease(
                    owner="someone",
                    token=uuid.uuid4().hex,
                    attempt=failed.attempt,
                    expires_at=utcnow() + timedelta(minutes=1),
                ).model_dump()
            }
        ),
    )
    assert isinstance(held, RunDocument)
    await _refused(store, failed.run_id, "body", RunBusy)


async def test_rewind_of_a_finished_run_is_refused(
    env: LocalEnv, store: RunStore, load: Load
) -> None:
    done = await run_local(env, load("examples/budget_guard"), {"max_steps": 10})
    assert done.status is RunStatus.FINISHED
    await _refused(store, done.run_id, "step", RewindRefused)
