"""SPEC §12: every knob is a `RUNFLEET_*` variable with a documented default.

The audit changed defaults in the settings classes and no test noticed: the CLI, the runner and
the publisher all read them, so a drifted default silently changes the fleet's behaviour. Each
settings class is built here with no `RUNFLEET_*` variable set, and each default compared with
the value SPEC states (§12, and the sections §12 points to: §3, §5, §7, §8, §10b).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineSettings
from engine.sandbox.kubernetes.settings import KubernetesSandboxSettings
from publisher.config import WireSettings
from runner.config import RunnerSettings
from store.config import StoreSettings

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def bare_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No `RUNFLEET_*` variable, and a working directory with no `.runfleet` in it."""
    for name in list(os.environ):
        if name.startswith("RUNFLEET_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


Read = Callable[[], Any]

DEFAULTS: list[tuple[str, Read, Any]] = [
    # §12, §5.4: the lease.
    ("RUNFLEET_LEASE_TTL", lambda: EngineSettings().lease_ttl, timedelta(seconds=30)),
    ("RUNFLEET_LEASE_INTERVAL", lambda: EngineSettings().lease_interval, timedelta(seconds=10)),
    ("RUNFLEET_LEASE_SKEW", lambda: EngineSettings().lease_skew, timedelta(seconds=2)),
    (
        "RUNFLEET_LEASE_LOSS_MARGIN (TTL/6)",
        lambda: EngineSettings().lease_timing().loss_margin,
        timedelta(seconds=5),
    ),
    ("wire RUNFLEET_LEASE_TTL", lambda: WireSettings().lease_ttl, timedelta(seconds=30)),
    ("wire RUNFLEET_LEASE_SKEW", lambda: WireSettings().lease_skew, timedelta(seconds=2)),
    # §12, §3: the consumer and the streams.
    (
        "RUNFLEET_ACK_WAIT (TTL + skew)",
        lambda: WireSettings().effective_ack_wait,
        timedelta(seconds=32),
    ),
    ("RUNFLEET_MAX_DELIVER", lambda: WireSettings().max_deliver, 10),
    ("RUNFLEET_DUPLICATE_WINDOW", lambda: WireSettings().duplicate_window, timedelta(minutes=5)),
    ("RUNFLEET_STREAM_REPLICAS", lambda: WireSettings().stream_replicas, 1),
    ("RUNFLEET_DELIVERY_LOG_TTL", lambda: WireSettings().delivery_log_ttl, timedelta(days=7)),
    # §5.9: the sweeper's interval and its grace (60 s after `attempt_at`).
    ("RUNFLEET_SWEEPER_INTERVAL", lambda: WireSettings().sweeper_interval, timedelta(seconds=30)),
    ("RUNFLEET_SWEEPER_GRACE", lambda: WireSettings().sweeper_grace, timedelta(seconds=60)),
    # §12, §5.1, §5.2, §5.5: the runner.
    ("RUNFLEET_SLOTS", lambda: RunnerSettings().slots, 8),
    ("RUNFLEET_TRANSIENT_DELAY", lambda: RunnerSettings().transient_delay, timedelta(seconds=5)),
    (
        "transient delay cap (10 min)",
        lambda: RunnerSettings().transient_delay_cap,
        timedelta(minutes=10),
    ),
    ("fetch timeout (0.5 s)", lambda: RunnerSettings().fetch_timeout, timedelta(seconds=0.5)),
    ("lagging-read nak (2 s)", lambda: RunnerSettings().lagging_delay, timedelta(seconds=2)),
    ("young-message window (30 s)", lambda: RunnerSettings().young_message, timedelta(seconds=30)),
    (
        "unsupported-schema nak (5 min)",
        lambda: RunnerSettings().unsupported_schema_delay,
        timedelta(minutes=5),
    ),
    ("drain nak (1 s)", lambda: RunnerSettings().drain_nak_delay, timedelta(seconds=1)),
    ("claim retries (3)", lambda: RunnerSettings().claim_retries, 3),
    # §5.4: the budgets the unwind ceiling is derived from.
    (
        "node cancellation budget (1 min)",
        lambda: EngineSettings().node_cancel_budget,
        timedelta(minutes=1),
    ),
    ("teardown budget (5 min)", lambda: EngineSettings().teardown_budget, timedelta(minutes=5)),
    (
        "scratch bank budget (4 min)",
        lambda: EngineSettings().scratch_bank_budget,
        timedelta(minutes=4),
    ),
    (
        "post-engine budget (1 min)",
        lambda: EngineSettings().post_engine_budget,
        timedelta(minutes=1),
    ),
    ("unwind margins (30 s)", lambda: EngineSettings().unwind_margin, timedelta(seconds=30)),
    # §12, §6.1, §7.3, §2: the engine.
    ("RUNFLEET_SANDBOX", lambda: EngineSettings().sandbox, "local"),
    ("RUNFLEET_SCRATCH_CAP", lambda: EngineSettings().scratch_cap, 256 * MiB),
    ("node output cap (1 MiB)", lambda: EngineSettings().output_cap, 1 * MiB),
    # §7.1: the kubernetes sandbox's setup phases.
    (
        "RUNFLEET_SANDBOX_SCHEDULE_BUDGET",
        lambda: KubernetesSandboxSettings().sandbox_schedule_budget,
        timedelta(minutes=5),
    ),
    (
        "RUNFLEET_SANDBOX_READY_BUDGET",
        lambda: KubernetesSandboxSettings().sandbox_ready_budget,
        timedelta(minutes=2),
    ),
    (
        "RUNFLEET_SANDBOX_SEED_BUDGET",
        lambda: KubernetesSandboxSettings().sandbox_seed_budget,
        timedelta(minutes=2),
    ),
    # §12, §2, §8: the store, the tenant and attachments.
    ("RUNFLEET_TENANT", lambda: StoreSettings().tenant, "default"),
    ("RUNFLEET_ATTACHMENT_MAX_BYTES", lambda: StoreSettings().attachment_max_bytes, 50 * MiB),
    ("RUNFLEET_ATTACHMENTS_MAX_COUNT", lambda: StoreSettings().attachments_max_count, 32),
    ("RUNFLEET_UPLOAD_TTL", lambda: StoreSettings().upload_ttl, timedelta(hours=24)),
]


@pytest.mark.parametrize(
    ("knob", "read", "spec_value"), DEFAULTS, ids=[knob for knob, _, _ in DEFAULTS]
)
def test_spec_12_every_knob_has_its_documented_default(
    knob: str, read: Read, spec_value: Any
) -> None:
    assert read() == spec_value, f"{knob}: SPEC's default is {spec_value!r}"


def test_spec_12_runfleet_data_defaults_to_dot_runfleet(tmp_path: Path) -> None:
    """`RUNFLEET_DATA` (default `./.runfleet`) is the embedded default's home, and the store
    and blob URLs default under it."""
    settings = StoreSettings()
    home = (tmp_path / ".runfleet").resolve()
    assert Path(settings.data).resolve() == home
    assert settings.effective_store_url == f"sqlite:///{home / 'runs.db'}"
    assert settings.effective_blob_url == f"file://{home / 'blobs'}"
