"""SPEC §5.4: the unwind ceiling is derived — node cancellation (1 min) + margin (30 s) +
teardown (5 min) + post-engine (1 min) + margin (30 s) — and defaults to 8 minutes.

The ceiling bounds how long a draining or cancelled execution may hold the lease, and
`deploy/` sizes `terminationGracePeriodSeconds` from it: a drifted derivation was caught by no
test (the audit's break went unnoticed).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from engine.config import EngineSettings


@pytest.fixture(autouse=True)
def bare_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RUNFLEET_"):
            monkeypatch.delenv(name)


def test_spec_5_4_the_derived_unwind_ceiling_defaults_to_8_minutes() -> None:
    assert EngineSettings().unwind_ceiling == timedelta(minutes=8)


def test_spec_5_4_the_unwind_ceiling_is_derived_from_its_budgets_and_both_margins() -> None:
    """Never set by hand: each budget and both margins move it."""
    settings = EngineSettings(
        node_cancel_budget=timedelta(seconds=10),
        teardown_budget=timedelta(seconds=20),
        scratch_bank_budget=timedelta(seconds=15),
        post_engine_budget=timedelta(seconds=7),
        unwind_margin=timedelta(seconds=3),
    )
    assert settings.unwind_ceiling == timedelta(seconds=10 + 3 + 20 + 7 + 3)
