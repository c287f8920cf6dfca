"""The scratch soak (`tests/soak_scratch.py`) at CI size: 4 runs whose scratch must follow them
across runner processes on different data directories (SQLite + S3/moto: a deployment that
banks), while runners are SIGKILLed mid-node, during a bank and during a restore. No run may go
on with a scratch that is not byte for byte the one it left (SPEC v2.2 §7.3-§7.5, §13.10):
each finishes with both checks `ok` or is refused `SCRATCH_NOT_PORTABLE`."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.soak_scratch import run_scratch_soak
from tests.soak_scratch_plan import ScratchSoakConfig

pytestmark = pytest.mark.timeout(300)


async def test_a_small_scratch_soak_loses_no_scratch(tmp_path: Path) -> None:
    seed = int(os.environ.get("RUNFLEET_SOAK_SEED") or random.SystemRandom().randrange(10**6))
    cfg = ScratchSoakConfig(
        runs=4, runners=2, mib=2, kill_every=6.0, seed=seed, data=tmp_path / "soak",
        deadline_s=200.0, quiet=True,
    )  # fmt: skip
    report = await run_scratch_soak(cfg)
    summary = f"seed {seed} (RUNFLEET_SOAK_SEED={seed} repeats the plan)\n{report.table()}"
    assert report.violations == [], summary
    assert report.lost_scratches == 0 and report.banked >= 1, summary
    assert report.finished + report.refused_surface + report.refused_admission >= 4, summary
