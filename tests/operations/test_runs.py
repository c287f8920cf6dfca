"""The run operations without the CLI (issue 20 item 2): each against a real SQLite store and
the real nats-server, returning its typed value or raising its typed error."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import AnswersInvalid
from engine.loader import load_workflow
from engine.refusals import RunNotResumable, ScratchNotPortable
from engine.resume import ResumeRequest
from publisher import WireNames, decode
from runner import operations as ops
from runner.operations import Env, is_refusal
from store import Checkpoint, Event, RunNotFound, RunStatus, ScratchRecord
from tests.console.test_api_uploads import ASKS_FILE
from tests.publisher.conftest import Nats, example, put_run, stream_messages


async def test_launch_queues_a_run_and_its_publication_is_on_the_work_stream(
    env: Env, nats_conn: Nats, names: WireNames
) -> None:
    run = await ops.launch(env, example("hello.yaml"), {"name": "Ada"})

    assert (run.status, run.attempt, run.tenant) == (RunStatus.QUEUED, 1, "default")
    (message,) = await stream_messages(nats_conn.js, names)
    decoded = decode(message.data or b"", message.headers)
    assert (decoded.run_id, decoded.attempt, decoded.kind) == (run.run_id, 1, "launch")
    assert run.publication is not None and run.publication.stream_seq == message.seq


async def test_run_local_executes_the_workflow_in_process_to_its_outcome(env: Env) -> None:
    seen: list[Event] = []
    run = await ops.run_local(env, example("hello.yaml"), {"name": "Ada"}, on_event=seen.append)

    assert run.status is RunStatus.FINISHED
    assert run.checkpoint is not None and run.checkpoint.outputs["greet"] == "hello Ada"
    assert "run_finished" in {e.type for e in seen}
    assert (await ops.get_run(env, run.run_id)).status is RunStatus.FINISHED


async def test_get_run_of_an_unknown_run_is_the_typed_refusal_run_not_found(env: Env) -> None:
    with pytest.raises(RunNotFound) as info:
        await ops.get_run(env, "no-such-run")
    assert info.value.code == "run_not_found"
    assert is_refusal(info.value)


async def test_list_runs_filters_by_status_code_and_tenant_and_pages(env: Env) -> None:
    parked = [
        await put_run(env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
        for _ in range(3)
    ]
    await put_run(env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="OTHER")
    await put_run(env.store, status=RunStatus.PAUSED_OPERATOR)
    await put_run(
        env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED", tenant="other"
    )

    first = await ops.list_runs(
        env, statuses=[RunStatus.FAILED_RESUMABLE], failure_codes=["DLQ_PARKED"], limit=2
    )
    rest = await ops.list_runs(
        env,
        statuses=[RunStatus.FAILED_RESUMABLE],
        failure_codes=["DLQ_PARKED"],
        limit=2,
        after=first.next_after,
    )
    assert [r.run_id for r in [*first.runs, *rest.runs]] == [r.run_id for r in parked]
    assert rest.next_after is None
    other = await ops.list_runs(env, tenant="other")
    assert [r.tenant for r in other.runs] == ["other"]


async def test_list_runs_by_code_alone_lists_runs_stopped_on_it_not_cancelled_since(
    env: Env,
) -> None:
    """`runs --code DLQ_PARKED` listed a parked run an operator had cancelled since (a direct
    cancel keeps the last code, which `status` shows as "earlier"); with no `--status`, a code
    means the runs that stand on it now. An explicit status still finds the others."""
    parked = await put_run(env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED")
    cancelled = await put_run(
        env.store, status=RunStatus.FAILED_RESUMABLE, failure_code="DLQ_PARKED"
    )
    assert (await ops.cancel(env, cancelled.run_id)).failure_code == "DLQ_PARKED"
    budget = await put_run(
        env.store, status=RunStatus.PAUSED_OPERATOR, failure_code="BUDGET_EXCEEDED"
    )

    by_code = await ops.list_runs(env, failure_codes=["DLQ_PARKED", "BUDGET_EXCEEDED"])
    assert {r.run_id for r in by_code.runs} == {parked.run_id, budget.run_id}
    also_cancelled = await ops.list_runs(
        env, statuses=[RunStatus.CANCELLED], failure_codes=["DLQ_PARKED"]
    )
    assert [r.run_id for r in also_cancelled.runs] == [cancelled.run_id]


async def test_event_batches_reads_a_runs_events_and_follow_ends_once_it_settled(
    env: Env,
) -> None:
    run = await ops.run_local(env, example("hello.yaml"), {})

    batches = [b async for b in ops.event_batches(env, run.run_id)]
    followed = [b async for b in ops.event_batches(env, run.run_id, follow=True)]
    later = [b async for b in ops.event_batches(env, run.run_id, after=2)]

    events = [e for batch in batches for e in batch]
    assert events[0].type == "run_launched" and events[-1].type == "run_finished"
    assert [e.seq for b in followed for e in b] == [e.seq for e in events]
    assert [e.seq for b in later for e in b] == [e.seq for e in events if e.seq > 2]
    with pytest.raises(RunNotFound):
        _ = [b async for b in ops.event_batches(env, "no-such-run")]


async def test_every_event_of_a_run_longer_than_one_page_is_read_and_the_timeline_too(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale drill: `events`, `events --deliveries`, the API's timeline and the console read
    one page (10 000) of a 40 000-event run and stopped there without a word."""
    import runner.operations.runs as runs_module

    run = await ops.run_local(env, example("hello.yaml"), {})
    stored = await env.store.read_events(run.run_id, 0, 1_000)
    assert len(stored) > 4
    monkeypatch.setattr(runs_module, "EVENTS_PAGE", 2)

    read = [e.seq for b in [b async for b in ops.event_batches(env, run.run_id)] for e in b]
    timeline = [
        entry.event.seq
        async for batch in ops.timeline_batches(env, run.run_id)
        for entry in batch
        if entry.event is not None
    ]
    assert sorted(read) == [e.seq for e in stored]
    assert sorted(timeline) == [e.seq for e in stored]


async def test_resume_queues_a_paused_run_as_its_next_attempt_on_the_stream(
    env: Env, nats_conn: Nats, names: WireNames
) -> None:
    run = await put_run(
        env.store,
        status=RunStatus.PAUSED_OPERATOR,
        checkpoint=Checkpoint(progress=2, completed=["greet"], restart_node="summarize"),
    )
    resumed = await ops.resume(env, run.run_id, ResumeRequest())

    assert (resumed.status, resumed.attempt) == (RunStatus.QUEUED, 2)
    (message,) = await stream_messages(nats_conn.js, names)
    assert (message.headers or {})["Nats-Msg-Id"] == f"{run.run_id}:2"
    # The history says it was resumed, and from what, as a local resume's does (SPEC §6.3).
    said = [(e.type, e.data, e.attempt) for e in await env.store.read_events(run.run_id)]
    assert said[-2:] == [
        ("run_resumed", {"from_status": "paused_operator"}, 2),
        ("run_queued", {"attempt": 2, "kind": "resume"}, 2),
    ]


async def test_resume_of_a_finished_run_is_refused_run_not_resumable(env: Env) -> None:
    run = await put_run(env.store, status=RunStatus.FINISHED)
    with pytest.raises(RunNotResumable) as info:
        await ops.resume(env, run.run_id, ResumeRequest())
    assert info.value.remedy


async def test_resume_local_answers_a_waiting_run_in_process(env: Env) -> None:
    waiting = await ops.run_local(env, example("approval.yaml"), {})
    assert waiting.status is RunStatus.PAUSED_WAITING_HUMAN

    with pytest.raises(AnswersInvalid):
        await ops.resume_local(
            env, waiting.run_id, ResumeRequest(cli_answers={"approved": "maybe"})
        )
    done = await ops.resume_local(
        env, waiting.run_id, ResumeRequest(cli_answers={"approved": "yes"})
    )
    assert (done.status, done.attempt) == (RunStatus.FINISHED, 2)


async def test_resume_local_holds_a_file_answer_as_an_attachment_like_a_queued_resume(
    env: Env, tmp_path: Path
) -> None:
    waiting = await ops.run_local(env, load_workflow(ASKS_FILE, "ask.yaml"), {})
    answer = tmp_path / "answer.txt"
    answer.write_text("the answer's bytes\n")

    done = await ops.resume_local(
        env, waiting.run_id, ResumeRequest(cli_answers={"doc": f"@{answer}"})
    )

    assert done.status is RunStatus.FINISHED, done.error
    (held,) = done.attachments
    assert (held.name, held.filename, held.bytes) == ("doc", "answer.txt", 19)
    assert await env.blobs.get_bytes(held.key) == b"the answer's bytes\n"
    assert done.checkpoint is not None
    assert str(done.checkpoint.outputs["show_doc"]).strip() == "the answer's bytes"


async def test_cancel_of_a_queued_run_cancels_it_directly(env: Env) -> None:
    run = await ops.launch(env, example("hello.yaml"), {})
    cancelled = await ops.cancel(env, run.run_id)
    assert cancelled.status is RunStatus.CANCELLED
    with pytest.raises(RunNotFound):
        await ops.cancel(env, run.run_id, tenant="other")  # another tenant's run is not here


async def test_rewind_moves_the_checkpoint_back_and_parks_the_run_paused_operator(
    env: Env,
) -> None:
    waiting = await ops.run_local(env, example("approval.yaml"), {})
    result = await ops.rewind(env, waiting.run_id, "prepare")

    assert result.run.status is RunStatus.PAUSED_OPERATOR
    assert result.run.checkpoint is not None
    assert result.run.checkpoint.restart_node == "prepare"
    assert "prepare" in result.dropped


async def test_a_resume_refused_for_an_unbankable_scratch_names_what_refused_the_bank(
    env: Env,
) -> None:
    """SPEC §7.4: a scratch the last teardown could not bank refuses the resume without
    `--accept-scratch-loss`. Why it could not be banked (here the bucket is missing) was only
    in the `sandbox_scratch_banked` event; the refusal names it, queued and local alike."""
    run = await put_run(
        env.store,
        status=RunStatus.FAILED_RESUMABLE,
        failure_code="TOOL_FAILED_TRANSIENT",
        scratch=ScratchRecord(state="unbankable", bytes=2048, progress=1),
    )
    cause = "not banked: S3BucketMissing('bucket runfleet-scratch does not exist')"
    await env.store.append_event(
        run.run_id, "sandbox_scratch_banked", {"banked": False, "reason": cause}, attempt=1
    )

    for resume in (ops.resume, ops.resume_local):
        with pytest.raises(ScratchNotPortable) as info:
            await resume(env, run.run_id, ResumeRequest())
        assert "could not bank a non-empty scratch" in info.value.message
        assert "bucket runfleet-scratch does not exist" in info.value.message
        assert "--accept-scratch-loss" in (info.value.remedy or "")
    assert (await ops.get_run(env, run.run_id)).status is RunStatus.FAILED_RESUMABLE


async def test_another_tenants_run_id_is_answered_exactly_as_an_id_no_run_has(env: Env) -> None:
    """An API walkthrough told another tenant's real run id from a made-up one by the
    message ("no run 'ID'" against "no run 'ID' (as an id or the start of one)")."""
    theirs = await put_run(env.store, status=RunStatus.QUEUED, tenant="other")
    made_up = theirs.run_id[:-4] + ("0000" if not theirs.run_id.endswith("0000") else "1111")

    with pytest.raises(RunNotFound) as for_theirs:
        await ops.get_run(env, theirs.run_id)
    with pytest.raises(RunNotFound) as for_none:
        await ops.get_run(env, made_up)

    def said(exc: RunNotFound, run_id: str) -> tuple[str, str | None]:
        return exc.message.replace(run_id, "ID"), exc.remedy

    assert said(for_theirs.value, theirs.run_id) == said(for_none.value, made_up)


async def test_a_page_continues_after_a_run_that_does_not_validate(
    env: Env, tmp_path: Path
) -> None:
    """A page whose last row was unreadable named it as `next_after`, and asking for the page
    after it answered 500 `document_invalid` (the API; `runs --after` exit 1): nothing past it
    could be listed (an API walkthrough)."""
    import sqlite3

    first = await put_run(env.store, status=RunStatus.QUEUED)
    bad = await put_run(env.store, status=RunStatus.QUEUED)
    last = await put_run(env.store, status=RunStatus.QUEUED)
    with sqlite3.connect(tmp_path / "runs.db") as conn:
        conn.execute(
            "UPDATE runs SET doc = json_set(doc, '$.attempt', 'x') WHERE run_id = ?",
            (bad.run_id,),
        )
    env.store.remembered.forget(bad.run_id)  # type: ignore[attr-defined]

    page = await ops.list_runs(env, limit=2)
    assert [r.run_id for r in page.runs] == [first.run_id]
    assert page.next_after == bad.run_id
    rest = await ops.list_runs(env, limit=2, after=page.next_after)
    assert [r.run_id for r in rest.runs] == [last.run_id]
    with pytest.raises(RunNotFound):  # still another tenant's business only by its index
        await ops.list_runs(env, after=bad.run_id, tenant="other")
