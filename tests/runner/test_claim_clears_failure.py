"""SPEC §5.3: every claim clears `failure_code` and `error`.

A run that failed and is claimed again is running, not failed: while its node runs under the
new claim, its document must not still carry the old failure (the CLI, the console and the
sweeper read those fields). The audit removed the clearing from the claim's CAS and no test
noticed, because the outcome's status write overwrites them later; so these tests read the
document while the node is still running under the new claim.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.local import new_run_id
from engine.resume import ResumeRequest
from runner.runner import Runner
from store import RunDocument, RunStatus
from tests.runner.callables import (
    body,
    bound_drain,
    entered,
    failed_at_hold,
    publish_raw,
    release,
)
from tests.runner.conftest import Fleet, eventually


@pytest.fixture
async def runner(fleet: Fleet) -> AsyncIterator[Runner]:
    runner = await fleet.start_runner(sweeper=False, backstop=False)
    yield runner
    bound_drain(fleet.runners)


async def running_under_claim(fleet: Fleet, gates: Path, run_id: str, attempt: int) -> RunDocument:
    """The document as it reads while the node runs under the claim of `attempt`."""

    async def holding() -> bool:
        return entered(gates, run_id) == [attempt]

    await eventually(holding)
    return await fleet.store.get_run(run_id)


async def test_spec_5_3_an_auto_retry_claim_clears_failure_code_and_error(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    """A transient failure (auto-resumable) is auto-retried by its redelivery."""
    run_id = new_run_id()
    await fleet.store.create_run(failed_at_hold(run_id, gates, "SANDBOX_LOST"))
    await publish_raw(fleet.js, fleet.names.runs_subject, body(run_id, 1), run_id=run_id, attempt=1)

    doc = await running_under_claim(fleet, gates, run_id, attempt=1)

    assert doc.status is RunStatus.RUNNING
    assert doc.lease is not None and doc.lease.attempt == 1
    assert (doc.failure_code, doc.error) == (None, None)
    release(gates, run_id)
    await fleet.wait_status(run_id, "finished")
    claims = [
        e.data["path"] for e in await fleet.store.read_events(run_id) if e.type == "run_claimed"
    ]
    assert claims == ["auto_retry"]


async def test_spec_5_3_a_fresh_claim_after_a_resume_clears_failure_code_and_error(
    fleet: Fleet, runner: Runner, gates: Path
) -> None:
    """An operator resumes an operator-resumable failure: the resume queues it (its CAS
    leaves the failure fields alone), and the fresh claim of the new attempt clears them."""
    run_id = new_run_id()
    await fleet.store.create_run(failed_at_hold(run_id, gates, "AMBIGUOUS_EFFECT"))

    resumed = await fleet.publisher.resume(run_id, ResumeRequest(), tenant="default")
    assert (resumed.status, resumed.attempt) == (RunStatus.QUEUED, 2)
    doc = await running_under_claim(fleet, gates, run_id, attempt=2)

    assert doc.status is RunStatus.RUNNING
    assert doc.lease is not None and doc.lease.attempt == 2
    assert (doc.failure_code, doc.error) == (None, None)
    release(gates, run_id)
    await fleet.wait_status(run_id, "finished")
