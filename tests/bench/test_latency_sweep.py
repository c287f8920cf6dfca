"""`bench.latency --rates`: the sweep's knee, and the sweep end to end at tiny sizes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from bench.latency import CpuShare, SweepPoint, knee, parse_rates

ROOT = Path(__file__).resolve().parents[2]


def point(asked: float, p99: float) -> SweepPoint:
    return SweepPoint(asked, asked * 0.99, 1.0, p99, CpuShare(1, 0, 0, 0, 0, 1))


def test_knee_is_the_last_rate_before_the_first_miss() -> None:
    points = [point(200, 4), point(600, 14), point(400, 8), point(800, 70), point(1000, 30)]
    # 1000 came out within target after 800 missed: a recovery past a miss is not a knee
    assert knee(points, 50) == pytest.approx(600 * 0.99)


def test_knee_is_zero_when_the_first_rate_misses() -> None:
    assert knee([point(100, 51), point(50, 60)], 50) == 0.0


def test_knee_counts_a_p99_equal_to_the_target() -> None:
    assert knee([point(100, 50.0)], 50) == pytest.approx(99.0)


@pytest.mark.parametrize("text", ["", "a,b", "100,-5", "0"])
def test_rates_refuses_what_is_not_positive_runs_per_second(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rates(text)


def test_rates_parses_a_comma_list() -> None:
    assert parse_rates("200, 400,1e3") == [200.0, 400.0, 1000.0]


def test_rate_and_rates_are_one_or_the_other() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.latency", "--rate", "100", "--rates", "100,200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr, proc.stderr


def test_sweep_runs_quick_and_names_its_knee() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.latency", "--quick", "--drain-only", "--rates", "20,40"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    output = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    assert "rate 20/s" in proc.stdout and "rate 40/s" in proc.stdout, output
    assert "| runs/s asked |" in proc.stdout, output
    assert "  sweep: p99" in proc.stdout, output
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1 and "sweep knee=" in summary[0], output
