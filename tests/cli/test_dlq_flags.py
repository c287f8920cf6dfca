"""`runfleet dlq` flag checks (SPEC §10: `dlq list [--reason R]`, `dlq replay ID…|--all [--reason
R]`, `dlq purge ID…|--all [--reason R] [--older-than D]`). A reason the fleet never writes, or a
filter beside record ids (which it cannot narrow), is a usage error (exit 2) naming the flag:
before, the first printed an empty list and the second was dropped without a word.

No fleet is needed: the flags are judged before anything is opened, so each command is pointed
at a NATS address where nothing listens — reaching it would be exit 4, not 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runner.operations.dlq import DLQ_REASONS
from tests.cli.conftest import runfleet_without_fleet


def runfleet(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return runfleet_without_fleet(tmp_path, *args)


@pytest.mark.parametrize(
    "args",
    [
        ("dlq", "list", "--reason", "bogus"),
        ("dlq", "replay", "--all", "--reason", "bogus"),
        ("dlq", "purge", "--all", "--reason", "bogus", "--yes"),
    ],
    ids=["list", "replay", "purge"],
)
def test_a_reason_the_fleet_never_writes_is_a_usage_error_naming_the_accepted_reasons(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    result = runfleet(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "'--reason'" in result.stderr and "'bogus'" in result.stderr
    assert all(reason in result.stderr for reason in DLQ_REASONS), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (("dlq", "replay", "7", "--reason", "retries_exhausted"), ["--reason"]),
        (("dlq", "purge", "7", "--reason", "malformed", "--yes"), ["--reason"]),
        (("dlq", "purge", "7", "--older-than", "1d", "--yes"), ["--older-than"]),
        (
            ("dlq", "purge", "7", "8", "--reason", "malformed", "--older-than", "1d", "--yes"),
            ["--reason", "--older-than"],
        ),
    ],
    ids=["replay-reason", "purge-reason", "purge-older-than", "purge-both"],
)
def test_a_filter_beside_record_ids_is_a_usage_error_saying_it_goes_with_all(
    tmp_path: Path, args: tuple[str, ...], flags: list[str]
) -> None:
    result = runfleet(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert all(flag in result.stderr for flag in flags), result.stderr
    assert "with --all, not with record ids" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_known_reason_with_all_gets_past_the_flag_checks(tmp_path: Path) -> None:
    """The checks refuse only what they should: a reason the fleet writes, with `--all`,
    reaches the (absent) NATS server."""
    result = runfleet(tmp_path, "dlq", "replay", "--all", "--reason", "retries_exhausted")
    assert result.returncode == 4, (result.stdout, result.stderr)
    assert result.stderr.startswith("error [nats_unavailable]")
