"""The protocol model's numbers: time (model seconds; `BASE` is the clock's zero), the broker's
limits, the size of the fleet, and the product's settings built from them."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

from engine.config import EngineSettings
from publisher.config import WireSettings
from publisher.wire import WireNames
from runner.config import RunnerSettings

BASE = datetime(2030, 1, 1, tzinfo=UTC)
TTL, INTERVAL, SKEW, MARGIN = 30.0, 10.0, 2.0, 5.0
ACK_WAIT = TTL + SKEW
LOSS_MARGIN = timedelta(seconds=MARGIN)
MAX_DELIVER = 3
"""Small, so last deliveries, DLQ parks and the backstop are reached in a few steps."""
DUP_WINDOW = 300.0
SWEEPER_GRACE, SWEEPER_INTERVAL = 60.0, 30.0
ADVISORY_ACK_WAIT = 30.0
RUNNERS = 3
SLOTS = 3

NAMES = WireNames("model")
WIRE = WireSettings(
    namespace="model",
    max_deliver=MAX_DELIVER,
    lease_ttl=timedelta(seconds=TTL),
    lease_skew=timedelta(seconds=SKEW),
    duplicate_window=timedelta(seconds=DUP_WINDOW),
    publish_attempts=1,
    publish_retry_budget=timedelta(seconds=5),
    sweeper_grace=timedelta(seconds=SWEEPER_GRACE),
    sweeper_interval=timedelta(seconds=SWEEPER_INTERVAL),
)
ENGINE = EngineSettings(
    lease_ttl=timedelta(seconds=TTL),
    lease_interval=timedelta(seconds=INTERVAL),
    lease_skew=timedelta(seconds=SKEW),
    lease_loss_margin=timedelta(seconds=MARGIN),
)
RUNNER = RunnerSettings(
    transient_delay=timedelta(seconds=5),
    lagging_delay=timedelta(seconds=2),
    claim_retries=3,
    drain_nak_delay=timedelta(seconds=1),
)

FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""A fresh SQLite file per example: on tmpfs its fsyncs (WAL switch, checkpoint at close) cost
nothing, where a disk makes them most of an example's time."""
