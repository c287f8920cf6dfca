"""A store that stops answering mid-run is an outage, not a bug (a network drill: one runner
paused holding SQLite's write lock stalled every other runner's writes). The run fails with the
transient INTERNAL_ERROR, which is retried, and the log says what happened without a traceback
that reads like a crash."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from engine.failures import FailureCode
from engine.outcome import Failed
from runner.delivery import _run
from store import StoreUnavailable


class _Execution:
    """Only what `_run` touches: a claim that landed, then a store that does not answer."""

    run_id = "r-outage"

    def __init__(self, error: Exception) -> None:
        self.cancel = SimpleNamespace(reason=None)
        self.error = error

    async def begin(self, path: str, owner: str) -> None:
        raise self.error


async def _outcome(error: Exception) -> Any:
    svc = SimpleNamespace(owner="runner-a", draining=False)
    return await _run(svc, _Execution(error), "/tmp/unused")  # type: ignore[arg-type]


async def test_a_store_outage_mid_run_fails_transiently_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="runner.delivery")
    outcome = await _outcome(StoreUnavailable("database is locked"))
    assert isinstance(outcome, Failed)
    assert outcome.code == FailureCode.INTERNAL_ERROR
    assert "store unavailable" in outcome.error
    (record,) = [r for r in caplog.records if r.name == "runner.delivery"]
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert "the store did not answer" in record.getMessage()


async def test_any_other_error_mid_run_is_still_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="runner.delivery")
    outcome = await _outcome(KeyError("bug"))
    assert isinstance(outcome, Failed) and outcome.code == FailureCode.INTERNAL_ERROR
    (record,) = [r for r in caplog.records if r.name == "runner.delivery"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
