"""`runfleet resume --max-cost-usd X --max-iterations N` (SPEC §10 v2.2: a bad flag value is a
usage error naming the flag, the value and the accepted form). `nan` was taken as a cost cap
no cost ever passes, printed as a bare `NaN` by `--json`; negatives reached the store as a
refusal about the budget instead of the flag.

No fleet is needed: the flags are judged before anything is opened."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.cli.conftest import runfleet_without_fleet


def resume(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return runfleet_without_fleet(tmp_path, "resume", "0123456789ab", "--local", *flags)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-cost-usd", "nan"),
        ("--max-cost-usd", "inf"),
        ("--max-cost-usd", "-3"),
        ("--max-cost-usd", "1e13"),
        ("--max-cost-usd", "lots"),
        ("--max-iterations", "-1"),
        ("--max-iterations", "0"),
    ],
)
def test_a_budget_flag_outside_what_a_budget_can_hold_is_a_usage_error_naming_it(
    tmp_path: Path, flag: str, value: str
) -> None:
    result = resume(tmp_path, flag, value)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert f"Invalid value for '{flag}'" in result.stderr and value in result.stderr
    assert not (tmp_path / "data" / "runs.db").exists(), "the store was opened"


def test_a_budget_flag_in_range_gets_past_the_flag_checks(tmp_path: Path) -> None:
    result = resume(tmp_path, "--max-cost-usd", "2.5", "--max-iterations", "20")
    assert result.returncode == 3, result.stderr  # the run is unknown: judged by the store
    assert "run_not_found" in result.stderr
