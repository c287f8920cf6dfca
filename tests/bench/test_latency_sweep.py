"""`bench.latency --rates`: the sweep's knee, and the sweep end to end at tiny sizes."""

from __future__ import annotations

import argparse

import pytest

from bench.latency import CpuShare, SweepPoint, knee, parse_rates
from tests.bench.script import run_bench


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
    run = run_bench("latency", "--rate", "100", "--rates", "100,200", timeout=60)
    assert run.returncode == 2 and "not allowed with argument" in run.stderr, run.output


def test_sweep_runs_quick_and_names_its_knee() -> None:
    run = run_bench("latency", "--quick", "--drain-only", "--rates", "20,40")
    assert run.returncode == 0, run.output
    assert "rate 20/s" in run.stdout and "rate 40/s" in run.stdout, run.output
    assert "| runs/s asked |" in run.stdout, run.output
    assert "  sweep: p99" in run.stdout, run.output
    assert len(run.summaries) == 1 and "sweep knee=" in run.summaries[0], run.output
