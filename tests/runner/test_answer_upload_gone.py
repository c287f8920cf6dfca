"""A queued file answer whose staged upload is gone before a runner promotes it (SPEC §6.4, §8, §5.2
step 7): `resume --answer doc=@PATH` staged the file and sent its upload id through the queue; the
upload is then reaped (`RUNFLEET_UPLOAD_TTL`), discarded or loses its bytes before the fresh claim,
or its staged bytes no longer match their digest. The runner refuses the answer — the run is put
back where the resume found it, `paused_waiting_human` at the same question with
`ATTACHMENTS_UNFETCHABLE` and the cause, the delivery acked — never naks it as an internal error and
never records it in the DLQ. A new answer then resumes it.

Real parts: the session's nats-server, a SQLite store, a filesystem blob store, an in-process
runner, and the operations the CLI calls (`runner.operations.resume`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.failures import FailureCode
from engine.resume import ResumeRequest
from runner import operations as ops
from runner.operations import Env
from store import RunDocument
from store.config import StoreSettings
from store.staging import StagingStore
from tests.console.test_api_uploads import ASKS_FILE  # ask `doc` (a file), then cat it
from tests.runner.conftest import Fleet


def operator_env(fleet: Fleet) -> Env:
    """What `runfleet resume` opens on this fleet."""
    settings = StoreSettings(data=fleet.tmp / "operator", tenant="default")
    return Env(settings, fleet.engine, fleet.store, fleet.blobs, "runfleet-test-cli", fleet.wire)


async def answer_with_a_file(env: Env, run_id: str, path: Path) -> RunDocument:
    """`runfleet resume RUN --answer doc=@PATH`: staged here, its upload id queued."""
    request = ResumeRequest(cli_answers={"doc": f"@{path}"}, answers_base_dir=path.parent)
    return await ops.resume(env, run_id, request)


async def paused_at_the_question(fleet: Fleet) -> RunDocument:
    runner = await fleet.start_runner()
    run = await fleet.launch(ASKS_FILE)
    paused = await fleet.wait_status(run.run_id, "paused_waiting_human")
    await runner.shutdown()  # no runner claims the resume until the upload is gone
    fleet.runners.remove(runner)
    return paused


@pytest.mark.parametrize(
    "how", ["reaped", "bytes_lost", "other_bytes_under_the_key", "staged_bytes_corrupted"]
)
async def test_a_file_answer_whose_upload_is_gone_is_refused_and_the_run_waits_for_a_new_answer(
    fleet: Fleet, how: str
) -> None:
    env = operator_env(fleet)
    paused = await paused_at_the_question(fleet)
    first = fleet.tmp / "first.txt"
    first.write_text("the first answer\n")
    queued = await answer_with_a_file(env, paused.run_id, first)
    assert queued.status == "queued" and queued.resume_spec is not None
    upload_id = queued.resume_spec.answers["doc"]["upload"]
    staging = StagingStore(fleet.store, fleet.blobs)
    staged = await staging.get(upload_id, "default")
    key = f"runs/{paused.run_id}/attachments/doc"
    if how == "bytes_lost":  # the record is there, its bytes are not
        await fleet.blobs.delete(staged.files[0].key)
    elif how == "staged_bytes_corrupted":  # as long as the staged file, not its digest
        await fleet.blobs.put_bytes(staged.files[0].key, b"x" * staged.files[0].bytes)
    elif how != "staged_bytes_corrupted":  # the sweeper's reap past RUNFLEET_UPLOAD_TTL
        assert await staging.discard(upload_id, "default")
    if how == "other_bytes_under_the_key":  # an earlier answer's: not this one's, even as long
        await fleet.blobs.put_bytes(key, b"x" * staged.files[0].bytes)

    await fleet.start_runner()
    refused = await fleet.wait_status(paused.run_id, "paused_waiting_human")

    # Put back where the resume found it: the same question, none of the resume's effects.
    assert refused.attempt == queued.attempt
    assert refused.failure_code == FailureCode.ATTACHMENTS_UNFETCHABLE
    assert refused.error is not None and "'doc'" in refused.error and upload_id in refused.error
    assert refused.checkpoint is not None and refused.checkpoint.pending_interaction is not None
    assert refused.checkpoint.pending_interaction["node"] == "ask"
    assert "ask" not in refused.checkpoint.outputs
    assert refused.attachments == []
    if how != "other_bytes_under_the_key":
        assert await fleet.blobs.list(f"runs/{paused.run_id}/attachments/") == []
    events = await fleet.store.read_events(paused.run_id)
    failed = [e for e in events if e.type == "run_failed" and e.attempt == queued.attempt]
    assert [e.data["code"] for e in failed] == ["ATTACHMENTS_UNFETCHABLE"]
    # Refused at its first delivery and acked: no internal error, no retry, no DLQ record.
    assert await fleet.queue_drained()
    assert await fleet.dlq.list() == []

    # ... and resumable with a new answer.
    second = fleet.tmp / "second.txt"
    second.write_text("the second answer\n")
    await answer_with_a_file(env, paused.run_id, second)
    done = await fleet.wait_status(paused.run_id, "finished")
    assert done.checkpoint is not None
    assert done.checkpoint.outputs["show_doc"] == "the second answer"
    assert [(a.name, a.filename) for a in done.attachments] == [("doc", "second.txt")]
