"""How `runfleet status` words a failure code (found by an operator walkthrough): a code is
the run's state only while the run is failed, failed_resumable or paused_operator; on a parked
run an operator cancelled, or a failed one resumed and queued, it read as the current failure
(`failure DLQ_PARKED` on a `cancelled` run). The cause is shown beside the code."""

from __future__ import annotations

import pytest

from runner.cli.views import echo_run
from store import RunStatus
from tests.store.conftest import MakeRun
from tests.store.conftest import make_run as make_run

PARKED = {"failure_code": "DLQ_PARKED", "cause_code": "TOOL_FAILED_TRANSIENT", "error": "gave up"}


def test_a_parked_run_shows_its_failure_with_the_cause(
    make_run: MakeRun, capsys: pytest.CaptureFixture[str]
) -> None:
    echo_run(make_run(status=RunStatus.FAILED_RESUMABLE, **PARKED), dlq_record=42)
    out = capsys.readouterr().out
    assert "failure   DLQ_PARKED (cause TOOL_FAILED_TRANSIENT): gave up" in out
    assert "`runfleet dlq replay 42`" in out


@pytest.mark.parametrize("status", [RunStatus.CANCELLED, RunStatus.QUEUED, RunStatus.FINISHED])
def test_a_code_the_run_has_moved_on_from_is_shown_as_earlier(
    make_run: MakeRun, capsys: pytest.CaptureFixture[str], status: RunStatus
) -> None:
    echo_run(make_run(status=status, **PARKED))
    out = capsys.readouterr().out
    assert "failure " not in out
    assert f"earlier   DLQ_PARKED (cause TOOL_FAILED_TRANSIENT): gave up (now {status})" in out
    assert "dlq replay" not in out
