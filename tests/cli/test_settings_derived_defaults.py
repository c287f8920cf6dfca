"""SPEC §12 and §5.4: the defaults that are *derived* from other settings follow them.

`test_settings_defaults.py` compares each default with SPEC with every variable unset, where a
derived default and a hard-coded constant read the same (TTL/6 of 30 s is 5 s either way). Here
the settings they derive from are moved, so a derivation replaced by a constant is caught:

- §12 `RUNFLEET_LEASE_LOSS_MARGIN` (default TTL/6);
- §12 `RUNFLEET_ACK_WAIT` (default TTL + skew);
- §5.4 the unwind ceiling: 8 minutes by default, "all configurable, the ceiling derived, never
  set by hand" — a `RUNFLEET_UNWIND_CEILING` in the environment does not move it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from engine.config import EngineSettings
from publisher.config import WireSettings


@pytest.fixture(autouse=True)
def bare_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No `RUNFLEET_*` variable, and a working directory with no `.runfleet` in it."""
    for name in list(os.environ):
        if name.startswith("RUNFLEET_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_spec_12_lease_loss_margin_defaults_to_a_sixth_of_the_lease_ttl(
    bare_environment: pytest.MonkeyPatch,
) -> None:
    bare_environment.setenv("RUNFLEET_LEASE_TTL", "60s")
    bare_environment.setenv("RUNFLEET_LEASE_INTERVAL", "10s")

    timing = EngineSettings().lease_timing()

    assert timing.ttl == timedelta(seconds=60)
    assert timing.loss_margin == timedelta(seconds=10)


def test_spec_12_an_explicit_lease_loss_margin_replaces_the_derived_default(
    bare_environment: pytest.MonkeyPatch,
) -> None:
    bare_environment.setenv("RUNFLEET_LEASE_TTL", "60s")
    bare_environment.setenv("RUNFLEET_LEASE_INTERVAL", "10s")
    bare_environment.setenv("RUNFLEET_LEASE_LOSS_MARGIN", "7s")

    assert EngineSettings().lease_timing().loss_margin == timedelta(seconds=7)


def test_spec_12_ack_wait_defaults_to_lease_ttl_plus_skew(
    bare_environment: pytest.MonkeyPatch,
) -> None:
    bare_environment.setenv("RUNFLEET_LEASE_TTL", "1m")
    bare_environment.setenv("RUNFLEET_LEASE_SKEW", "3")  # plain seconds

    assert WireSettings().effective_ack_wait == timedelta(seconds=63)


def test_spec_5_4_the_unwind_ceiling_defaults_to_8_minutes_and_is_never_set_by_hand(
    bare_environment: pytest.MonkeyPatch,
) -> None:
    assert EngineSettings().unwind_ceiling == timedelta(minutes=8)

    bare_environment.setenv("RUNFLEET_UNWIND_CEILING", "1m")
    assert EngineSettings().unwind_ceiling == timedelta(minutes=8)

    bare_environment.setenv("RUNFLEET_TEARDOWN_BUDGET", "6m")  # one of the budgets it sums
    assert EngineSettings().unwind_ceiling == timedelta(minutes=9)
