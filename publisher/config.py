"""Publisher and wire settings (SPEC §3, §4, §12), read once from `RUNFLEET_*` variables."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from store.timeutil import Duration

NATS_URL_FILE = "nats.url"
"""Written by `runfleet up` under RUNFLEET_DATA so every other command finds the local fleet."""


class WireSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUNFLEET_", extra="ignore")

    data: Path = Path(".runfleet")
    nats_url: str | None = None
    nats_creds: Path | None = Field(default=None, description="NATS credentials file")
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle for NATS TLS")
    namespace: str = Field(default="", pattern=r"^[A-Za-z0-9_-]*$")
    stream_replicas: int = Field(default=1, ge=1, le=5)
    max_deliver: int = Field(default=10, ge=2)
    lease_ttl: Duration = timedelta(seconds=30)
    lease_skew: Duration = timedelta(seconds=2)
    ack_wait: Duration | None = Field(default=None, description="default lease TTL + skew")
    duplicate_window: Duration = timedelta(minutes=5)
    publish_timeout: Duration = timedelta(seconds=2)
    publish_attempts: int = Field(default=4, ge=1)
    publish_retry_budget: Duration = timedelta(seconds=20)
    sweeper_grace: Duration = timedelta(seconds=60)
    sweeper_interval: Duration = timedelta(seconds=30)

    @model_validator(mode="after")
    def _relations(self) -> WireSettings:
        if self.publish_retry_budget >= self.sweeper_grace:
            raise ValueError(
                "RUNFLEET_PUBLISH_RETRY_BUDGET must be shorter than RUNFLEET_SWEEPER_GRACE"
                " (else the sweeper republishes while a publish is still being retried)"
            )
        if self.ack_wait is not None and self.ack_wait < self.lease_ttl + self.lease_skew:
            raise ValueError(
                "RUNFLEET_ACK_WAIT must be >= RUNFLEET_LEASE_TTL + RUNFLEET_LEASE_SKEW"
            )
        if self.duplicate_window <= self.sweeper_grace + self.sweeper_interval:
            raise ValueError("the duplicate window must outlast the sweeper's grace + interval")
        return self

    @property
    def effective_ack_wait(self) -> timedelta:
        return self.ack_wait or self.lease_ttl + self.lease_skew

    def effective_nats_url(self) -> str:
        if self.nats_url:
            return self.nats_url
        url_file = self.data / NATS_URL_FILE
        if url_file.is_file():
            return url_file.read_text().strip()
        return "nats://127.0.0.1:4222"
