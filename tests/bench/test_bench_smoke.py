"""The benchmarks still run: each script with `--quick` (tiny sizes) exits 0 and prints its
`SUMMARY` line. Timings are never asserted: CI machines are shared and noisy; the numbers live
in docs/performance.md, measured by hand."""

from __future__ import annotations

import pytest

from tests.bench.script import run_bench

SCRIPTS = [
    "throughput",
    "latency",
    "recovery",
    "lease",
    "bank",
    "inproc",
    "sweep",
    "hotpath",
    "refresh",
    "dlq_list",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quick_and_prints_its_summary(script: str) -> None:
    run = run_bench(script, "--quick")
    assert run.returncode == 0, run.output
    assert len(run.summaries) == 1, run.output
    assert run.summaries[0].startswith(f"SUMMARY {script}:"), run.output
