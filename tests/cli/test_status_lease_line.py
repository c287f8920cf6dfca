"""`runfleet status` of a running run says who holds its lease and until when: after a runner
is SIGKILLed the run stays `running` under that runner's lease until it lapses, and the text
said nothing of it (an on-call walkthrough; `--json` had it)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from runner.cli.views import echo_run
from store import RunDocument, utcnow


def _running(expires_in_s: float) -> RunDocument:
    return RunDocument.model_validate(
        {
            "run_id": "r1",
            "workflow": {"name": "w", "source": "", "source_hash": "0" * 64},
            "status": "running",
            "attempt_at": utcnow(),
            "created_at": utcnow(),
            "updated_at": utcnow(),
            "lease": {
                "owner": "vm:26117",
                "token": "t",
                "attempt": 1,
                "expires_at": utcnow() + timedelta(seconds=expires_in_s),
            },
        }
    )


def test_status_of_a_running_run_names_its_lease_holder_and_expiry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    echo_run(_running(25))
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lease")]
    assert "vm:26117, expires in 2" in line


def test_a_lapsed_lease_is_said_to_have_lapsed(capsys: pytest.CaptureFixture[str]) -> None:
    echo_run(_running(-40))
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lease")]
    assert "vm:26117, lapsed 4" in line


def test_a_live_lease_does_not_claim_its_runner_is_alive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`status` cannot know whether the holder still runs: it says what happens if it died
    (it said "renewed while it runs" of a SIGKILLed runner's lease)."""
    echo_run(_running(25))
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lease")]
    assert "renewed while it runs" not in line
    assert "if that runner died, the run is taken over once it lapses" in line
