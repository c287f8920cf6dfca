"""The benchmarks still run: each script with `--quick` (tiny sizes) exits 0 and prints its
`SUMMARY` line. Timings are never asserted: CI machines are shared and noisy; the numbers live
in docs/performance.md, measured by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quick_and_prints_its_summary(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{script}", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    output = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summaries) == 1, output
    assert summaries[0].startswith(f"SUMMARY {script}:"), output
