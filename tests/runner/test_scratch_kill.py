"""A runner killed before its teardown banked (adr/0011, amendment; SPEC v2.2 §7.3, §7.4,
§13.10): on a deployment that banks, the first tool node of an execution marks the scratch
record `unknown` under its lease token, so after a SIGKILL nothing silently resumes on an empty
or older scratch — the adoption is refused `SCRATCH_NOT_PORTABLE`, the surface refuses too, and
`--accept-scratch-loss` passes.

Real parts: nats-server, a `runfleet runner` process on SQLite with an S3 (moto) blob store — not
host-backed, so it banks — and a second runner on another data directory (another host)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.failures import FailureCode
from engine.refusals import ScratchNotPortable
from engine.resume import ResumeRequest
from engine.sandbox.local import LocalSandboxDriver
from runner.config import RunnerSettings
from runner.runner import Runner
from store import RunDocument, RunStatus
from store.blob_url import open_blob_store
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import runner_process, wait_for_ledger
from tests.support.s3server import S3Server, running_s3_server

WORKFLOW = """\
name: scratch_kill
entry: write
vars:
  ledger: {type: string}
  release: {type: string}
nodes:
  write:
    kind: tool
    run: >-
      echo kept > "$RUNFLEET_SCRATCH_DIR/kept.txt" && echo write >> {{ vars.ledger }} && echo ok
  wait:
    kind: tool
    run: >-
      echo wait >> {{ vars.ledger }};
      while [ ! -e {{ vars.release }} ]; do sleep 0.05; done; echo released
  check:
    kind: tool
    run: 'cat "$RUNFLEET_SCRATCH_DIR/kept.txt" 2>/dev/null || echo lost'
edges:
  - {from: write, to: wait}
  - {from: wait, to: check}
"""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with running_s3_server() as server:
        yield server


async def banking_env(s3: S3Server) -> dict[str, str]:
    bucket = await s3.new_bucket()
    return {
        "RUNFLEET_BLOB_URL": f"s3://{bucket}/fleet?endpoint={s3.endpoint_url}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": s3.region,
    }


async def runner_on(fleet: Fleet, host: str, env: dict[str, str]) -> Runner:
    """An in-process runner on its own data directory, on the same store and S3 bucket."""
    runner = Runner(
        store=fleet.store,
        driver=LocalSandboxDriver(fleet.tmp / host),
        data_dir=fleet.tmp / host,
        blobs=open_blob_store(env["RUNFLEET_BLOB_URL"], env=env),
        settings=RunnerSettings(
            slots=2, http_host="127.0.0.1", transient_delay="0.2s", lagging_delay="0.2s"
        ),
        engine=fleet.engine,
        wire=fleet.wire,
        owner=f"runner-{host}",
    )
    await runner.start()
    fleet.runners.append(runner)
    return runner


async def test_a_runner_killed_before_its_teardown_banked_leaves_a_resume_refused_scratch_not_portable(  # noqa: E501
    fleet: Fleet, s3: S3Server, tmp_path: Path
) -> None:
    env = await banking_env(s3)
    book, release = tmp_path / "ledger", tmp_path / "release"
    async with runner_process(fleet, "runner-a", env=env) as a:
        run = await fleet.launch(WORKFLOW, {"ledger": str(book), "release": str(release)})
        await wait_for_ledger(book, "wait")  # `write` finished: its file is in a's scratch
        a.signal(signal.SIGKILL)
        assert await a.wait_exit(10) == -signal.SIGKILL

    killed = await fleet.store.get_run(run.run_id)
    assert killed.checkpoint is not None and killed.checkpoint.completed == ["write"]
    assert killed.lease is not None and killed.scratch is not None
    # the mark the first tool node wrote: nothing banked, as of before `write`, by a's lease
    assert killed.scratch.state == "unknown" and killed.scratch.key is None
    assert killed.scratch.lease_token == killed.lease.token and killed.scratch.progress == 0

    release.touch()
    await runner_on(fleet, "host-b", env)  # the redelivery after ack_wait: an adoption

    async def parked() -> RunDocument | None:
        doc = await fleet.store.get_run(run.run_id)
        return doc if doc.failure_code == FailureCode.SCRATCH_NOT_PORTABLE else None

    doc = await eventually(parked, within=30)
    assert doc.status is RunStatus.FAILED_RESUMABLE and "ended before its teardown" in (
        doc.error or ""
    )
    assert doc.checkpoint is not None and doc.checkpoint.completed == ["write"]
    with pytest.raises(ScratchNotPortable):  # the surface refuses as well ...
        await fleet.publisher.resume(run.run_id, ResumeRequest(force=True), tenant="default")
    # ... until the loss is accepted: then the run goes on, knowingly without the file.
    await fleet.publisher.resume(
        run.run_id, ResumeRequest(accept_scratch_loss=True), tenant="default"
    )
    done = await fleet.wait_status(run.run_id, RunStatus.FINISHED, within=30)
    assert done.checkpoint is not None and done.checkpoint.outputs["check"] == "lost"
    events = await fleet.store.read_events(run.run_id, 0, 10_000)
    restored = [e.data for e in events if e.type == "sandbox_scratch_restored"]
    assert [r["accepted"] for r in restored] == [True]


async def test_a_runner_killed_before_any_tool_node_finished_resumes_on_a_fresh_scratch(
    fleet: Fleet, s3: S3Server, tmp_path: Path
) -> None:
    """The mark refuses only what was lost: killed in the first tool node (nothing finished
    since the mark), the adoption runs it again on an empty scratch, as a fresh run would."""
    env = await banking_env(s3)
    book, release = tmp_path / "ledger", tmp_path / "release"
    source = WORKFLOW.replace("entry: write", "entry: wait")
    async with runner_process(fleet, "runner-a", env=env) as a:
        run = await fleet.launch(source, {"ledger": str(book), "release": str(release)})
        await wait_for_ledger(book, "wait")
        a.signal(signal.SIGKILL)
        assert await a.wait_exit(10) == -signal.SIGKILL
    release.touch()
    await runner_on(fleet, "host-b", env)
    done = await fleet.wait_status(run.run_id, RunStatus.FINISHED, within=30)
    assert done.checkpoint is not None and done.checkpoint.outputs["check"] == "lost"
    assert done.failure_code is None


def test_an_unknown_mark_refuses_only_once_a_sandbox_node_finished_after_it() -> None:
    """`scratch_problem` on the mark (§7.4's "moved past its bank", applied to `unknown`): a
    kill inside the node that follows the mark loses nothing that node will not redo."""
    from datetime import UTC, datetime

    from engine.resume import scratch_problem
    from store import Checkpoint, ScratchRecord, WorkflowRef

    mark = ScratchRecord(state="unknown", progress=2, lease_token="dead", key="runs/r/s/t.tgz")
    base = RunDocument(
        run_id="r",
        workflow=WorkflowRef(name="w", source="x", source_hash="0" * 64),
        status=RunStatus.RUNNING,
        attempt_at=datetime.now(UTC),
        created_at=datetime.now(UTC),
        updated_at=datetime.now(UTC),
        scratch=mark,
        checkpoint=Checkpoint(progress=2, completed=["a", "b"], sandbox_done={"a": 1}),
    )
    assert scratch_problem(base) is None  # killed in the node after the mark
    cp = Checkpoint(progress=3, completed=["a", "b", "c"], sandbox_done={"a": 1, "c": 3})
    moved = base.model_copy(update={"checkpoint": cp})
    assert "dead" in (scratch_problem(moved) or "")  # `c` finished, then no teardown
    forsaken = moved.model_copy(update={"scratch": mark.model_copy(update={"forsaken": True})})
    assert scratch_problem(forsaken) is None  # the loss was accepted (§7.5)
