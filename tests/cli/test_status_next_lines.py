"""`runfleet status` says what a person can do next with a run that waits on one (a newcomer's
walkthrough: only a parked run had a `next` line; a cancelled, failed, budget-paused or
scratch-refused run left the reader to find the command). A run that moves by itself, is done,
or asks its questions has none."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from runner.cli.views import echo_run, next_line
from store import Checkpoint, Lease, RunStatus, utcnow
from tests.store.conftest import MakeRun
from tests.store.conftest import make_run as make_run

S = RunStatus


@pytest.mark.parametrize(
    ("status", "fields", "said"),
    [
        (S.CANCELLED, {}, "`runfleet resume {id}` continues it from its checkpoint"),
        (
            S.PAUSED_OPERATOR,
            {"failure_code": "BUDGET_EXCEEDED", "error": "iterations cap 3 reached"},
            "`runfleet resume {id} --max-iterations N`",
        ),
        (S.PAUSED_OPERATOR, {}, "`runfleet resume {id}` continues it"),
        (
            S.FAILED_RESUMABLE,
            {"failure_code": "SCRATCH_NOT_PORTABLE", "error": "bank gone"},
            "`runfleet resume {id} --accept-scratch-loss`",
        ),
        (
            S.FAILED_RESUMABLE,
            {"failure_code": "AMBIGUOUS_EFFECT", "error": "charged?"},
            "then `runfleet resume {id}` runs the node again",
        ),
        (
            S.FAILED_RESUMABLE,
            {"failure_code": "BUDGET_GUARD", "error": "over budget"},
            "fix the cause, then `runfleet resume {id}`",
        ),
        (
            S.FAILED,
            {
                "failure_code": "TOOL_FAILED_PERMANENT",
                "error": "exit 2",
                "checkpoint": Checkpoint(),
            },
            "`runfleet rewind {id} --node NODE --file FIXED.yaml`",
        ),
    ],
    ids=[
        "cancelled",
        "budget",
        "rewound",
        "scratch-not-portable",
        "ambiguous-effect",
        "fail-node-code",
        "failed",
    ],
)
def test_status_names_the_next_step_of_a_run_that_waits_on_a_person(
    make_run: MakeRun,
    capsys: pytest.CaptureFixture[str],
    status: RunStatus,
    fields: dict[str, Any],
    said: str,
) -> None:
    doc = make_run(status=status, **fields)
    echo_run(doc)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("next ")]
    assert len(lines) == 1, lines
    assert said.format(id=doc.run_id) in lines[0]


def test_a_running_run_no_runner_holds_names_cancel_then_resume(make_run: MakeRun) -> None:
    lapsed = Lease(owner="gone:1", token="t", attempt=1, expires_at=utcnow() - timedelta(minutes=5))
    doc = make_run(status=S.RUNNING, lease=lapsed)
    step = next_line(doc)
    assert step is not None
    assert f"`runfleet cancel {doc.run_id}` then `runfleet resume {doc.run_id}`" in step


@pytest.mark.parametrize(
    ("status", "fields"),
    [
        (S.QUEUED, {}),
        (S.FINISHED, {}),
        (S.PAUSED_WAITING_HUMAN, {}),
        (S.FAILED_RESUMABLE, {"failure_code": "TOOL_FAILED_TRANSIENT", "error": "retrying"}),
    ],
    ids=["queued", "finished", "waiting-human", "retried-by-itself"],
)
def test_a_run_that_moves_by_itself_is_done_or_asks_its_questions_has_no_next_line(
    make_run: MakeRun, status: RunStatus, fields: dict[str, Any]
) -> None:
    assert next_line(make_run(status=status, **fields)) is None


def test_a_running_run_under_a_live_lease_has_no_next_line(make_run: MakeRun) -> None:
    live = Lease(owner="r:1", token="t", attempt=1, expires_at=utcnow() + timedelta(seconds=30))
    assert next_line(make_run(status=S.RUNNING, lease=live)) is None


def test_a_run_that_failed_before_it_ran_is_told_to_launch_again_not_rewind(
    make_run: MakeRun,
) -> None:
    doc = make_run(status=S.FAILED, failure_code="LAUNCH_FAILED", error="no such file")
    step = next_line(doc)
    assert step is not None
    assert "launch it again" in step and "rewind" not in step


def test_a_local_run_whose_process_is_gone_is_taken_over_with_resume_local(
    make_run: MakeRun, capsys: pytest.CaptureFixture[str]
) -> None:
    """No queue carries a `runfleet run` run: nothing takes it over by itself, so neither the
    lease line nor the next line may promise a redelivery (an audit)."""
    lapsed = Lease(owner="vm:9", token="t", attempt=1, expires_at=utcnow() - timedelta(minutes=5))
    doc = make_run(status=S.RUNNING, lease=lapsed, origin="local")
    echo_run(doc)
    out = capsys.readouterr().out
    assert "redelivery" not in out and "sweeper" not in out
    assert f"`runfleet resume {doc.run_id} --local` takes it over" in out
    step = next_line(doc)
    assert step is not None and "--local" in step
