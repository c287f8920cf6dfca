"""The publisher (SPEC §4): launch, resume (refusals in order, one CAS, publish, record),
cancel, replay, and what a failed publish leaves behind. Real JetStream, real run stores."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NoStreamResponseError

from engine.errors import AnswersInvalid, AnswersRequired
from engine.loader import LoadedWorkflow, load_workflow_file
from engine.refusals import (
    BudgetBelowConsumed,
    RunNotResumable,
    ScratchNotPortable,
    WorkflowSourceChanged,
)
from engine.resume import ResumeRequest
from publisher import (
    DlqStore,
    DuplicatePublication,
    Publisher,
    PublishFailed,
    RecordNotFound,
    RecordNotReplayable,
    ResumeTooLarge,
    RunMessage,
    RunNotCancellable,
    StaleRecord,
    WireNames,
    WireSettings,
    connect,
    decode,
    encode,
    ensure_streams,
)
from store import (
    Budget,
    BudgetUsage,
    Checkpoint,
    Eq,
    Refusal,
    RunAlreadyExists,
    RunDocument,
    RunNotFound,
    RunStatus,
    RunStore,
    ScratchRecord,
    Update,
    utcnow,
)
from tests.publisher.conftest import (
    BarrierOnFirstReads,
    Nats,
    approval_pending,
    body,
    event_types,
    example,
    expired_lease,
    live_lease,
    put_run,
    stream_count,
    stream_messages,
    wire_settings,
)
from tests.support.nats_server import NatsServer

BOTH_STORES = pytest.mark.parametrize("run_store", ["sqlite", "mongomock"], indirect=True)

PAUSED_WITH_CHECKPOINT: dict[str, Any] = {
    "status": RunStatus.PAUSED_OPERATOR,
    "checkpoint": Checkpoint(progress=2, completed=["greet"], restart_node="summarize"),
}


async def paused_run(store: RunStore, **fields: Any) -> RunDocument:
    return await put_run(store, **{**PAUSED_WITH_CHECKPOINT, **fields})


async def waiting_run(store: RunStore, **fields: Any) -> RunDocument:
    """Paused on `examples/approval.yaml`'s `review` question."""
    checkpoint = Checkpoint(
        progress=1, completed=["prepare"], pending_interaction=approval_pending()
    )
    return await put_run(
        store,
        status=RunStatus.PAUSED_WAITING_HUMAN,
        workflow="approval.yaml",
        checkpoint=checkpoint,
        **fields,
    )


def changed_hello(tmp_path: Path) -> LoadedWorkflow:
    """`examples/hello.yaml` with one more comment: same graph, another source hash."""
    path = tmp_path / "hello.yaml"
    path.write_text(example("hello.yaml").source + "\n# edited\n")
    return load_workflow_file(path)


# -- launch -----------------------------------------------------------------------------------


async def test_launch_puts_a_message_on_the_stream_matching_the_wire_contract(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    before = utcnow()
    run = await publisher.launch(example("hello.yaml"), {"name": "Ada"}, tenant="acme")

    assert run.status is RunStatus.QUEUED
    assert run.attempt == 1
    assert run.tenant == "acme"
    assert run.inputs == {"name": "Ada"}
    assert run.workflow.source == example("hello.yaml").source
    assert run.publication is not None
    assert run.publication.attempt == 1

    messages = await stream_messages(nats_conn.js, names)
    assert len(messages) == 1
    msg = messages[0]
    assert msg.seq == run.publication.stream_seq
    assert msg.subject == names.runs_subject

    raw = body(msg)
    assert raw["v"] == 1
    assert (raw["run_id"], raw["tenant"], raw["attempt"], raw["kind"]) == (
        run.run_id,
        "acme",
        1,
        "launch",
    )
    decoded = decode(msg.data or b"", msg.headers)
    assert before <= decoded.published_at <= utcnow()

    headers = msg.headers or {}
    assert headers["Nats-Msg-Id"] == f"{run.run_id}:1"
    assert headers["Runfleet-Attempt"] == "1"
    assert headers["Runfleet-Schema"] == "1"

    assert await event_types(run_store, run.run_id) == ["run_launched", "run_queued"]


async def test_launch_records_the_publication_without_bumping_the_version(
    publisher: Publisher, run_store: RunStore
):
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    # The record is written without the launch waiting for it (issue 19 lever 3).
    await publisher.flush()
    stored = await run_store.get_run(run.run_id)
    # create → version 1; the publication write does not bump it (SPEC §2).
    assert stored.version == 1 and stored.publication == run.publication
    assert stored.publication is not None and stored.publication.stream_seq is not None


async def test_launch_with_an_existing_id_is_refused_and_the_existing_run_untouched(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    first = await publisher.launch(example("hello.yaml"), {}, tenant="default", run_id="fixed-1")
    events_before = await event_types(run_store, "fixed-1")

    with pytest.raises(RunAlreadyExists):
        await publisher.launch(example("approval.yaml"), {}, tenant="default", run_id="fixed-1")

    await publisher.flush()
    after = await run_store.get_run("fixed-1")
    assert after == first
    assert (after.version, after.status, after.workflow.name) == (1, RunStatus.QUEUED, "hello")
    assert await stream_count(nats_conn.js, names) == 1
    assert await event_types(run_store, "fixed-1") == events_before


async def test_launch_refuses_bad_vars_before_writing_anything(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    with pytest.raises(Refusal):
        await publisher.launch(example("hello.yaml"), {"nope": "x"}, tenant="default", run_id="r")
    with pytest.raises(RunNotFound):
        await run_store.get_run("r")
    assert await stream_count(nats_conn.js, names) == 0


# -- resume -----------------------------------------------------------------------------------


async def test_resume_publishes_attempt_n_plus_one_with_its_own_msg_id(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    launched = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    # An execution parked it (queued → paused_operator is legal: an admission park).
    await run_store.update_run(
        launched.run_id,
        [Eq("status", RunStatus.QUEUED), Eq("attempt", 1)],
        Update(set={"status": RunStatus.PAUSED_OPERATOR, "checkpoint": Checkpoint(progress=1)}),
    )

    resumed = await publisher.resume(
        launched.run_id, ResumeRequest(budget=Budget(max_iterations=50)), tenant="default"
    )

    assert resumed.status is RunStatus.QUEUED
    assert resumed.attempt == 2
    assert resumed.attempt_at > launched.attempt_at
    assert resumed.resume_spec is not None
    assert resumed.resume_spec.attempt == 2
    assert resumed.resume_spec.prior_status is RunStatus.PAUSED_OPERATOR
    assert resumed.resume_spec.budget == Budget(max_iterations=50)

    messages = await stream_messages(nats_conn.js, names)
    assert len(messages) == 2  # the new attempt was not deduplicated against the launch
    first, second = messages
    assert (first.headers or {})["Nats-Msg-Id"] == f"{launched.run_id}:1"
    assert (second.headers or {})["Nats-Msg-Id"] == f"{launched.run_id}:2"
    assert (second.headers or {})["Runfleet-Attempt"] == "2"
    message = decode(second.data or b"", second.headers)
    assert (message.attempt, message.kind) == (2, "resume")
    assert message.resume is not None and message.resume.budget == Budget(max_iterations=50)

    assert resumed.publication is not None
    assert (resumed.publication.attempt, resumed.publication.stream_seq) == (2, second.seq)
    assert (await event_types(run_store, launched.run_id))[-1] == "run_queued"


async def test_resume_events_ride_with_its_cas_before_anything_a_runner_writes(
    publisher: Publisher, run_store: RunStore, monkeypatch: pytest.MonkeyPatch
):
    """SPEC §6.3: events in the order things happened. A resume's `run_resumed` and
    `run_queued` were appended after its publish, so a runner that claimed and finished the
    run meanwhile had its events numbered first (a workflow walkthrough: `run_finished` seq
    14, `run_resumed` 15). Here a runner's event lands while the publish is in flight."""
    launched = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    await run_store.update_run(
        launched.run_id,
        [Eq("status", RunStatus.QUEUED), Eq("attempt", 1)],
        Update(set={"status": RunStatus.PAUSED_OPERATOR, "checkpoint": Checkpoint(progress=1)}),
    )
    publish = publisher.publish

    async def claimed_while_publishing(run: Any, kind: Any, **kw: Any) -> Any:
        ack = await publish(run, kind, **kw)
        await run_store.append_event(run.run_id, "run_claimed", {}, attempt=run.attempt)
        return ack

    monkeypatch.setattr(publisher, "publish", claimed_while_publishing)
    await publisher.resume(launched.run_id, ResumeRequest(), tenant="default")

    types = await event_types(run_store, launched.run_id)
    assert types[-3:] == ["run_resumed", "run_queued", "run_claimed"]


async def test_resume_whose_attempt_the_sweeper_published_first_is_queued_not_failed(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    """Found by the protocol model: a resume stalled between its CAS and its publish past the
    sweeper's grace; the sweeper republished the queued attempt under its `Nats-Msg-Id`, so the
    resume's own first publish is answered duplicate. That copy carries the attempt: the
    resume is queued with it, never flipped back (nor the operator told it failed)."""
    launched = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    await run_store.update_run(
        launched.run_id,
        [Eq("status", RunStatus.QUEUED), Eq("attempt", 1)],
        Update(set={"status": RunStatus.PAUSED_OPERATOR, "checkpoint": Checkpoint(progress=1)}),
    )
    swept = await nats_conn.js.publish(
        names.runs_subject,
        b"the sweeper's copy of attempt 2",
        stream=names.runs_stream,
        headers={"Nats-Msg-Id": f"{launched.run_id}:2"},
    )

    resumed = await publisher.resume(launched.run_id, ResumeRequest(), tenant="default")

    assert (resumed.status, resumed.attempt) == (RunStatus.QUEUED, 2)
    assert resumed.publication is not None
    assert (resumed.publication.attempt, resumed.publication.stream_seq) == (2, swept.seq)
    assert len(await stream_messages(nats_conn.js, names)) == 2  # not stored twice
    assert (await event_types(run_store, launched.run_id))[-1] == "run_queued"


async def test_resume_clears_cancel_requested(publisher: Publisher, run_store: RunStore):
    run = await put_run(
        run_store,
        status=RunStatus.CANCELLED,
        cancel_requested=True,
    )
    resumed = await publisher.resume(run.run_id, ResumeRequest(), tenant="default")
    assert resumed.status is RunStatus.QUEUED
    assert resumed.cancel_requested is False


async def test_resume_with_answers_puts_them_in_the_resume_spec(
    publisher: Publisher, run_store: RunStore
):
    run = await waiting_run(run_store)
    resumed = await publisher.resume(
        run.run_id, ResumeRequest(cli_answers={"approved": "yes"}), tenant="default"
    )
    assert resumed.resume_spec is not None
    assert resumed.resume_spec.answers == {"approved": True, "note": None}
    # Consents and answers are the claim's to apply: the checkpoint is not touched here.
    assert resumed.checkpoint == run.checkpoint


async def test_a_resume_too_large_for_one_nats_message_is_refused_before_anything_is_written(
    publisher: Publisher, run_store: RunStore, nats_conn: Nats, names: WireNames
):
    """An answer of more than the server's `max_payload` (1 MiB by default) was a 503
    `publish_failed` that no retry could ever mend, and each try raised the run's attempt
    (an API walkthrough). Refused `resume_too_large` (the API's 413) with nothing written."""
    run = await waiting_run(run_store)
    before = await event_types(run_store, run.run_id)
    note = "x" * (nats_conn.nc.max_payload + 1)

    with pytest.raises(ResumeTooLarge, match="max_payload") as refused:
        await publisher.resume(
            run.run_id,
            ResumeRequest(answers={"approved": True, "note": note}),
            tenant="default",
        )

    assert refused.value.code == "resume_too_large"
    after = await run_store.get_run(run.run_id)
    assert (after.status, after.attempt) == (run.status, run.attempt)
    assert await event_types(run_store, run.run_id) == before
    assert await stream_count(nats_conn.js, names) == 0


@BOTH_STORES
async def test_two_concurrent_resumes_publish_exactly_one_publication(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    run = await paused_run(run_store)
    publisher.store = BarrierOnFirstReads(run_store)  # type: ignore[assignment]

    results = await asyncio.gather(
        publisher.resume(run.run_id, ResumeRequest(), tenant="default"),
        publisher.resume(run.run_id, ResumeRequest(), tenant="default"),
        return_exceptions=True,
    )

    winners = [r for r in results if isinstance(r, RunDocument)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1, results
    assert len(losers) == 1, results
    assert isinstance(losers[0], RunNotResumable)
    assert losers[0].code == "run_not_resumable"

    assert await stream_count(nats_conn.js, names) == 1
    after = await run_store.get_run(run.run_id)
    assert (after.status, after.attempt) == (RunStatus.QUEUED, 2)
    assert after.publication is not None and after.publication.attempt == 2
    assert (await event_types(run_store, run.run_id)).count("run_queued") == 1


# -- refusals, in SPEC §4 order ---------------------------------------------------------------


async def assert_refused_and_nothing_written(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    run: RunDocument,
    request: ResumeRequest,
    expected: type[Refusal],
    *,
    tenant: str = "default",
) -> Refusal:
    events_before = await event_types(run_store, run.run_id)
    with pytest.raises(expected) as info:
        await publisher.resume(run.run_id, request, tenant=tenant)
    after = await run_store.get_run(run.run_id)
    assert after == run, "a refused resume must write nothing on the run"
    assert await stream_count(nats_conn.js, names) == 0, "a refused resume must publish nothing"
    assert await event_types(run_store, run.run_id) == events_before
    return info.value


async def test_resume_of_an_unknown_run_is_run_not_found(publisher: Publisher):
    with pytest.raises(RunNotFound) as info:
        await publisher.resume("no-such-run", ResumeRequest(), tenant="default")
    assert info.value.code == "run_not_found"


async def test_resume_of_another_tenants_run_is_run_not_found(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    run = await paused_run(run_store, tenant="other")
    refusal = await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, ResumeRequest(), RunNotFound
    )
    assert refusal.code == "run_not_found"
    assert "other" not in refusal.message  # nothing about the other tenant leaks


async def test_not_found_comes_before_not_resumable_for_another_tenant(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    run = await put_run(run_store, status=RunStatus.FINISHED, tenant="other")
    await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, ResumeRequest(), RunNotFound
    )


@pytest.mark.parametrize(
    "status", [RunStatus.FINISHED, RunStatus.FAILED, RunStatus.QUEUED, RunStatus.RUNNING]
)
async def test_resume_of_a_run_in_a_non_resumable_status_is_run_not_resumable(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    status: RunStatus,
):
    run = await put_run(run_store, status=status)
    refusal = await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, ResumeRequest(), RunNotResumable
    )
    assert refusal.code == "run_not_resumable"
    assert refusal.remedy


async def test_resume_of_a_waiting_run_without_answers_is_answers_required(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    run = await waiting_run(run_store)
    refusal = await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, ResumeRequest(), AnswersRequired
    )
    assert refusal.code == "answers_required"
    assert "approved" in refusal.message


@pytest.mark.parametrize(
    "request_",
    [
        ResumeRequest(answers={"approved": "maybe"}),
        ResumeRequest(cli_answers={"approved": "maybe"}),
    ],
    ids=["typed-json", "cli-string"],
)
async def test_resume_with_an_answer_of_the_wrong_type_is_answers_invalid_naming_the_field(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    request_: ResumeRequest,
):
    run = await waiting_run(run_store)
    refusal = await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, request_, AnswersInvalid
    )
    assert refusal.code == "answers_invalid"
    assert isinstance(refusal, AnswersInvalid)
    assert refusal.field == "approved"
    assert "approved" in refusal.message


async def test_resume_with_an_unbankable_scratch_is_scratch_not_portable(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    run = await paused_run(run_store, scratch=ScratchRecord(state="unbankable"))
    refusal = await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, ResumeRequest(), ScratchNotPortable
    )
    assert refusal.code == "scratch_not_portable"
    assert isinstance(refusal, ScratchNotPortable)
    assert refusal.also_needs_force is False
    assert "also_needs_force" not in refusal.to_dict()
    assert "--accept-scratch-loss" in (refusal.remedy or "")


async def test_accepting_scratch_loss_lets_the_resume_through(
    publisher: Publisher, run_store: RunStore
):
    run = await paused_run(run_store, scratch=ScratchRecord(state="unbankable"))
    resumed = await publisher.resume(
        run.run_id, ResumeRequest(accept_scratch_loss=True), tenant="default"
    )
    assert resumed.status is RunStatus.QUEUED
    assert resumed.resume_spec is not None
    assert resumed.resume_spec.consents.accept_scratch_loss is True
    # The consent is recorded for the claim; the bank record itself is not touched here.
    assert resumed.scratch == run.scratch


async def test_resume_with_a_changed_source_without_force_is_workflow_source_changed(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    tmp_path: Path,
):
    run = await paused_run(run_store)
    refusal = await assert_refused_and_nothing_written(
        publisher,
        nats_conn,
        names,
        run_store,
        run,
        ResumeRequest(new_source=changed_hello(tmp_path)),
        WorkflowSourceChanged,
    )
    assert refusal.code == "workflow_source_changed"
    assert "--force" in (refusal.remedy or "")


async def test_the_same_source_needs_no_force(publisher: Publisher, run_store: RunStore):
    run = await paused_run(run_store)
    resumed = await publisher.resume(
        run.run_id, ResumeRequest(new_source=example("hello.yaml")), tenant="default"
    )
    assert resumed.status is RunStatus.QUEUED
    assert resumed.resume_spec is not None and resumed.resume_spec.workflow is None


async def test_forcing_a_changed_source_queues_it_in_the_resume_spec(
    publisher: Publisher, run_store: RunStore, tmp_path: Path
):
    run = await paused_run(run_store)
    new = changed_hello(tmp_path)
    resumed = await publisher.resume(
        run.run_id, ResumeRequest(new_source=new, force=True), tenant="default"
    )
    assert resumed.resume_spec is not None
    assert resumed.resume_spec.workflow is not None
    assert resumed.resume_spec.workflow.source_hash == new.source_hash
    assert resumed.workflow == run.workflow  # swapped in only by the claim


async def test_one_refusal_names_both_consents_when_scratch_and_source_apply(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    tmp_path: Path,
):
    run = await paused_run(run_store, scratch=ScratchRecord(state="unbankable"))
    refusal = await assert_refused_and_nothing_written(
        publisher,
        nats_conn,
        names,
        run_store,
        run,
        ResumeRequest(new_source=changed_hello(tmp_path)),
        ScratchNotPortable,
    )
    assert isinstance(refusal, ScratchNotPortable)
    assert refusal.also_needs_force is True
    assert refusal.to_dict()["also_needs_force"] is True
    assert refusal.to_dict()["code"] == "scratch_not_portable"
    remedy = refusal.remedy or ""
    assert "--accept-scratch-loss" in remedy and "--force" in remedy


async def test_scratch_refusal_does_not_ask_for_force_already_given(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    tmp_path: Path,
):
    run = await paused_run(run_store, scratch=ScratchRecord(state="unbankable"))
    refusal = await assert_refused_and_nothing_written(
        publisher,
        nats_conn,
        names,
        run_store,
        run,
        ResumeRequest(new_source=changed_hello(tmp_path), force=True),
        ScratchNotPortable,
    )
    assert isinstance(refusal, ScratchNotPortable)
    assert refusal.also_needs_force is False


async def test_resume_with_a_cap_below_consumption_is_budget_below_consumed(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    run = await paused_run(
        run_store,
        checkpoint=Checkpoint(progress=3, usage=BudgetUsage(iterations=5, cost_usd=1.5)),
    )
    refusal = await assert_refused_and_nothing_written(
        publisher,
        nats_conn,
        names,
        run_store,
        run,
        ResumeRequest(budget=Budget(max_iterations=2)),
        BudgetBelowConsumed,
    )
    assert refusal.code == "budget_below_consumed"
    assert "max_iterations" in refusal.message


# Order: each case sets up two problems; the one earlier in SPEC §4 is the one reported.
ORDER_CASES = [
    pytest.param("not_resumable_before_answers", RunNotResumable, id="status-before-answers"),
    pytest.param("required_before_scratch", AnswersRequired, id="required-before-scratch"),
    pytest.param("invalid_before_scratch", AnswersInvalid, id="invalid-before-scratch"),
    pytest.param("scratch_before_budget", ScratchNotPortable, id="scratch-before-budget"),
    pytest.param("source_before_budget", WorkflowSourceChanged, id="source-before-budget"),
]


async def _order_case(
    case: str, store: RunStore, tmp_path: Path
) -> tuple[RunDocument, ResumeRequest]:
    unbankable = ScratchRecord(state="unbankable")
    used = Checkpoint(progress=3, usage=BudgetUsage(iterations=5))
    if case == "not_resumable_before_answers":
        run = await put_run(
            store,
            status=RunStatus.FINISHED,
            workflow="approval.yaml",
            checkpoint=Checkpoint(pending_interaction=approval_pending()),
        )
        return run, ResumeRequest(answers={"approved": "maybe"})
    if case == "required_before_scratch":
        return await waiting_run(store, scratch=unbankable), ResumeRequest()
    if case == "invalid_before_scratch":
        run = await waiting_run(store, scratch=unbankable)
        return run, ResumeRequest(answers={"approved": "maybe"})
    if case == "scratch_before_budget":
        run = await paused_run(store, scratch=unbankable, checkpoint=used)
        return run, ResumeRequest(budget=Budget(max_iterations=1))
    run = await paused_run(store, checkpoint=used)
    return run, ResumeRequest(new_source=changed_hello(tmp_path), budget=Budget(max_iterations=1))


@pytest.mark.parametrize(("case", "expected"), ORDER_CASES)
async def test_refusals_come_in_the_order_of_the_spec(
    publisher: Publisher,
    nats_conn: Nats,
    names: WireNames,
    run_store: RunStore,
    tmp_path: Path,
    case: str,
    expected: type[Refusal],
):
    run, request = await _order_case(case, run_store, tmp_path)
    await assert_refused_and_nothing_written(
        publisher, nats_conn, names, run_store, run, request, expected
    )


# -- a failed publish -------------------------------------------------------------------------


@pytest.fixture
async def own_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NatsServer]:
    """A server of this test's own, which it may stop for good (the session one is shared)."""
    server = NatsServer(tmp_path_factory.mktemp("nats-own"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def own_publisher(
    own_server: NatsServer, run_store: RunStore, names: WireNames
) -> AsyncIterator[Publisher]:
    settings = wire_settings(nats_url=own_server.url)
    nc, js = await connect(settings, name="test-publish-failure")
    try:
        await ensure_streams(js, names, settings)
        yield Publisher(
            store=run_store,
            nc=nc,
            js=js,
            settings=settings,
            names=names,
            dlq=DlqStore(js, names, None),
        )
    finally:
        # The test may have stopped the server for good: closing then finds the socket gone.
        with contextlib.suppress(OSError):
            await nc.close()


async def test_publish_failure_leaves_the_run_in_its_prior_status_with_an_event(
    own_server: NatsServer, own_publisher: Publisher, run_store: RunStore
):
    run = await paused_run(run_store, attempt=3)
    own_server.stop()

    with pytest.raises(PublishFailed) as info:
        await own_publisher.resume(run.run_id, ResumeRequest(), tenant="default")
    assert info.value.code == "publish_failed"

    after = await run_store.get_run(run.run_id)
    assert after.status is RunStatus.PAUSED_OPERATOR
    assert after.attempt == 4  # the attempt never decreases: a copy that landed is superseded
    assert after.publication is None
    events = await run_store.read_events(run.run_id)
    # The resume's events ride with its CAS (it was queued, for a moment), as a launch's do;
    # the flip back says where it went and why.
    assert [e.type for e in events] == ["run_resumed", "run_queued", "run_requeue_failed"]
    assert {e.attempt for e in events} == {4}
    assert events[-1].data["back_to"] == "paused_operator"
    assert events[-1].data["reason"]


async def test_a_run_put_back_after_a_failed_publish_can_be_resumed_again(
    own_server: NatsServer, own_publisher: Publisher, run_store: RunStore, names: WireNames
):
    run = await paused_run(run_store)
    own_server.stop()
    with pytest.raises(PublishFailed):
        await own_publisher.resume(run.run_id, ResumeRequest(), tenant="default")
    own_server.start()
    await own_publisher.nc.flush(timeout=10)  # reconnected to the same server

    resumed = await own_publisher.resume(run.run_id, ResumeRequest(), tenant="default")
    assert (resumed.status, resumed.attempt) == (RunStatus.QUEUED, 3)
    messages = await stream_messages(own_publisher.js, names)
    ids = [(m.headers or {})["Nats-Msg-Id"] for m in messages]
    # The client may flush the failed attempt's buffered copy once it reconnects: it lands as
    # attempt 2, superseded by the run's attempt 3 (which is why the attempt never goes back).
    assert ids[-1] == f"{run.run_id}:3"
    assert set(ids[:-1]) <= {f"{run.run_id}:2"}
    assert resumed.publication is not None
    assert resumed.publication.stream_seq == messages[-1].seq


async def test_a_launch_whose_publish_fails_ends_failed_launch_failed(
    own_server: NatsServer, own_publisher: Publisher, run_store: RunStore
):
    own_server.stop()
    with pytest.raises(PublishFailed):
        await own_publisher.launch(
            example("hello.yaml"), {}, tenant="default", run_id="launch-fails"
        )
    run = await run_store.get_run("launch-fails")
    assert run.status is RunStatus.FAILED
    assert run.failure_code == "LAUNCH_FAILED"
    assert run.error
    assert run.attempt == 1
    assert run.publication is None
    assert await event_types(run_store, "launch-fails") == [
        "run_launched",
        "run_queued",
        "run_failed",
    ]


# -- duplicates -------------------------------------------------------------------------------


async def test_republish_of_the_same_attempt_is_a_jetstream_duplicate(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    message = RunMessage(
        run_id="dup-run", tenant="default", attempt=1, kind="launch", published_at=utcnow()
    )
    data, headers = encode(message)
    first = await nats_conn.js.publish(names.runs_subject, data, headers=headers)
    again = await nats_conn.js.publish(names.runs_subject, data, headers=headers)
    assert first.duplicate is not True
    assert again.duplicate is True
    assert again.seq == first.seq
    assert await stream_count(nats_conn.js, names) == 1

    # Through the publisher: a first publish of an attempt whose id was used is an error.
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    with pytest.raises(DuplicatePublication) as info:
        await publisher.publish(run, "resume")
    assert info.value.code == "duplicate_publication"
    assert await stream_count(nats_conn.js, names) == 2


async def test_a_sweep_republish_uses_its_own_msg_id_and_is_not_a_duplicate(
    publisher: Publisher, nats_conn: Nats, names: WireNames
):
    run = await publisher.launch(example("hello.yaml"), {}, tenant="default")
    ack = await publisher.publish(run, "sweep", sweep=1)
    assert ack.duplicate is not True
    messages = await stream_messages(nats_conn.js, names)
    assert [(m.headers or {})["Nats-Msg-Id"] for m in messages] == [
        f"{run.run_id}:1",
        f"{run.run_id}:1:s1",
    ]


# -- cancel -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status",
    [
        RunStatus.QUEUED,
        RunStatus.PAUSED_OPERATOR,
        RunStatus.PAUSED_WAITING_HUMAN,
        RunStatus.FAILED_RESUMABLE,
    ],
)
async def test_cancel_of_a_queued_paused_or_failed_resumable_run_is_direct(
    publisher: Publisher, run_store: RunStore, status: RunStatus
):
    run = await put_run(run_store, status=status, attempt=2)
    cancelled = await publisher.cancel(run.run_id, tenant="default")
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.attempt == 2
    assert cancelled.cancel_requested is False
    assert cancelled.checkpoint == run.checkpoint  # the checkpoint is kept
    assert await event_types(run_store, run.run_id) == ["run_cancelled"]


async def test_cancel_of_a_running_run_with_a_live_lease_asks_it_to_stop(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    lease = live_lease()
    run = await put_run(run_store, status=RunStatus.RUNNING, lease=lease)
    sub = await nats_conn.nc.subscribe(names.control_subject(run.run_id))
    await nats_conn.nc.flush()
    try:
        result = await publisher.cancel(run.run_id, tenant="default")
        signal = await sub.next_msg(timeout=10)
    finally:
        await sub.unsubscribe()

    assert signal.subject == names.control_subject(run.run_id)
    assert result.status is RunStatus.RUNNING  # the execution writes `cancelled` itself
    assert result.cancel_requested is True
    stored = await run_store.get_run(run.run_id)
    assert stored.cancel_requested is True
    assert stored.lease == lease


async def test_cancel_of_a_running_run_whose_lease_is_free_cancels_directly(
    publisher: Publisher, run_store: RunStore
):
    run = await put_run(run_store, status=RunStatus.RUNNING, lease=expired_lease())
    cancelled = await publisher.cancel(run.run_id, tenant="default")
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.lease is None
    assert cancelled.cancel_requested is False
    assert (await run_store.get_run(run.run_id)).lease is None


@pytest.mark.parametrize("status", [RunStatus.FINISHED, RunStatus.FAILED, RunStatus.CANCELLED])
async def test_cancel_of_a_finished_run_is_run_not_cancellable(
    publisher: Publisher, run_store: RunStore, status: RunStatus
):
    run = await put_run(run_store, status=status)
    with pytest.raises(RunNotCancellable) as info:
        await publisher.cancel(run.run_id, tenant="default")
    assert info.value.code == "run_not_cancellable"
    assert await run_store.get_run(run.run_id) == run


async def test_cancel_of_another_tenants_run_is_run_not_found(
    publisher: Publisher, run_store: RunStore
):
    run = await put_run(run_store, status=RunStatus.QUEUED, tenant="other")
    with pytest.raises(RunNotFound):
        await publisher.cancel(run.run_id, tenant="default")
    assert await run_store.get_run(run.run_id) == run


# -- replay -----------------------------------------------------------------------------------


async def dead_letter(
    dlq: DlqStore, run: RunDocument, *, seq: int, attempt: int, replayable: bool = True
) -> None:
    message = RunMessage(
        run_id=run.run_id,
        tenant=run.tenant,
        attempt=attempt,
        kind="resume",
        published_at=utcnow(),
    )
    data, headers = encode(message)
    await dlq.put(
        seq=seq,
        body=data,
        headers=headers,
        reason="max_deliveries",
        run_id=run.run_id,
        attempt=attempt,
        num_delivered=10,
        runner="runner-a",
        replayable=replayable,
    )


async def test_replay_publishes_the_next_attempt_and_removes_the_record(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    assert publisher.dlq is not None
    run = await put_run(run_store, status=RunStatus.FAILED_RESUMABLE, attempt=2)
    await dead_letter(publisher.dlq, run, seq=17, attempt=2)

    replayed = await publisher.replay(17, tenant="default")

    assert (replayed.status, replayed.attempt) == (RunStatus.QUEUED, 3)
    messages = await stream_messages(nats_conn.js, names)
    assert len(messages) == 1
    message = decode(messages[0].data or b"", messages[0].headers)
    assert (message.attempt, message.kind) == (3, "replay")
    assert (messages[0].headers or {})["Nats-Msg-Id"] == f"{run.run_id}:3"
    assert replayed.publication is not None and replayed.publication.attempt == 3
    with pytest.raises(RecordNotFound):
        await publisher.dlq.get(17)


async def test_replay_of_a_stale_record_is_refused_and_the_record_stays(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    assert publisher.dlq is not None
    run = await put_run(run_store, status=RunStatus.FAILED_RESUMABLE, attempt=3)
    await dead_letter(publisher.dlq, run, seq=21, attempt=2)

    with pytest.raises(StaleRecord) as info:
        await publisher.replay(21, tenant="default")

    assert info.value.code == "stale_record"
    assert (await publisher.dlq.get(21)).attempt == 2
    assert await run_store.get_run(run.run_id) == run
    assert await stream_count(nats_conn.js, names) == 0


async def test_replay_of_a_record_with_no_run_to_resume_is_refused(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    assert publisher.dlq is not None
    run = await put_run(run_store, status=RunStatus.FAILED_RESUMABLE)
    await dead_letter(publisher.dlq, run, seq=5, attempt=1, replayable=False)

    with pytest.raises(RecordNotReplayable) as info:
        await publisher.replay(5, tenant="default")

    assert info.value.code == "record_not_replayable"
    assert (await publisher.dlq.get(5)).replayable is False
    assert await run_store.get_run(run.run_id) == run
    assert await stream_count(nats_conn.js, names) == 0


async def test_replay_of_a_run_that_is_not_resumable_keeps_the_record(
    publisher: Publisher, nats_conn: Nats, names: WireNames, run_store: RunStore
):
    assert publisher.dlq is not None
    run = await put_run(run_store, status=RunStatus.FINISHED)
    await dead_letter(publisher.dlq, run, seq=9, attempt=1)
    with pytest.raises(RunNotResumable):
        await publisher.replay(9, tenant="default")
    assert (await publisher.dlq.get(9)).run_id == run.run_id
    assert await stream_count(nats_conn.js, names) == 0


async def test_replay_of_an_unknown_record_is_record_not_found(publisher: Publisher):
    with pytest.raises(RecordNotFound):
        await publisher.replay(999, tenant="default")


def test_wire_settings_refuse_a_retry_budget_as_long_as_the_sweeper_grace():
    with pytest.raises(ValueError, match="RETRY_BUDGET"):
        WireSettings(publish_retry_budget="60s", sweeper_grace="60s")


async def test_a_publish_no_server_took_while_the_stream_answers_is_said_to_be_an_election(
    publisher: Publisher, monkeypatch: pytest.MonkeyPatch
):
    """The moment a replicated stream's new leader has not yet taken over its subjects: the
    publish gets "no responders" while the stream's info answers. Not a missing stream
    (`streams ensure` would not help): a wait. The publish is made to meet that moment on
    every try; the stream and its info are real."""
    publisher.settings = wire_settings(publish_attempts=2)

    async def nobody_took_it(*args: Any, **kwargs: Any) -> Any:
        raise NoStreamResponseError

    monkeypatch.setattr(publisher.js, "publish", nobody_took_it)
    with pytest.raises(PublishFailed) as info:
        await publisher.launch(example("hello.yaml"), {}, tenant="default")
    assert "failed after 2 tries" in info.value.message
    assert "the stream answers, but no server took the publish" in info.value.message
    assert "streams ensure" not in (info.value.remedy or "")
    assert "wait a few seconds and retry" in (info.value.remedy or "")
