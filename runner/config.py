"""Runner settings (SPEC §5, §12). The runner also reads `EngineSettings` (lease, budgets of
the unwind ceiling) and `WireSettings` (names, max_deliver, ack_wait): one variable, one meaning."""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field, model_validator

from store.settings import RunfleetSettings, duration_at_most
from store.timeutil import Duration, PositiveDuration


class RunnerSettings(RunfleetSettings):
    slots: int = Field(default=8, ge=1, le=10_000, description="concurrent deliveries")
    http_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    http_host: str = Field(
        default="0.0.0.0",
        pattern=r"^[A-Za-z0-9.:_-]+$",
        json_schema_extra={"accepted": "a host name or IP address to bind, e.g. 127.0.0.1"},
    )
    transient_delay: PositiveDuration = timedelta(seconds=5)
    transient_delay_cap: PositiveDuration = timedelta(minutes=10)
    fetch_timeout: PositiveDuration = timedelta(seconds=0.5)
    fetch_gather: Duration = Field(
        default=timedelta(milliseconds=4),
        le=timedelta(seconds=1),
        json_schema_extra={"accepted": "a duration from 0s to 1s, such as 4ms"},
        description="after a pull that emptied the queue, how long the next messages gather"
        " before the runner pulls again (ADR-0015 amendment 2); 0 pulls at once",
    )
    lagging_delay: PositiveDuration = timedelta(seconds=2)
    young_message: Duration = timedelta(seconds=30)
    unsupported_schema_delay: PositiveDuration = timedelta(minutes=5)
    drain_nak_delay: PositiveDuration = timedelta(seconds=1)
    claim_retries: int = Field(default=3, ge=0)
    sweeper: bool = Field(default=True, description="take part in the orphan sweeper")
    backstop: bool = Field(default=True, description="consume MAX_DELIVERIES advisories")
    healthy_within: PositiveDuration = timedelta(seconds=60)
    consumer_wait: Duration = Field(
        default=timedelta(seconds=30),
        description="how long a starting runner waits for the consumer to answer (a leader"
        " election on a NATS cluster takes a few seconds)",
    )

    @model_validator(mode="after")
    def _relations(self) -> RunnerSettings:
        """A transient failure's nak delay doubles from `transient_delay` up to its cap: a
        delay over its cap was silently cut down to the cap (a clocks review)."""
        duration_at_most(self, "transient_delay", "transient_delay_cap", "it doubles up to it")
        return self
