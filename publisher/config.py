"""Publisher and wire settings (SPEC §3, §4, §12), read once from `RUNFLEET_*` variables."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

from pydantic import Field, FilePath, field_validator, model_validator

from publisher.errors import NatsUnavailable
from store.settings import (
    EXISTING_FILE,
    DataDir,
    RunfleetSettings,
    SettingsRelation,
    env_name,
    format_duration,
)
from store.timeutil import Duration, PositiveDuration

_NATS_URL = re.compile(r"^(nats|tls|ws|wss)://\S+$")


def split_servers(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


NATS_URL_FILE = "nats.url"
"""Written by `runfleet up` under RUNFLEET_DATA so every other command finds the local fleet."""
UP_LOCK_FILE = "up.lock"
"""Under RUNFLEET_DATA: locked by the `runfleet up` that serves it (`runner.data_lock`)."""


class NatsSettings(RunfleetSettings):
    """Where NATS is and how to reach it, and the names' namespace: all that a command which
    only reads or removes DLQ records needs (so `dlq list` does not trip on a lease or publish
    setting it never uses)."""

    data: DataDir = Path(".runfleet")
    nats_url: str | None = Field(
        default=None,
        json_schema_extra={
            "accepted": "a NATS URL such as nats://127.0.0.1:4222, or several, comma-separated"
        },
    )
    nats_creds: FilePath | None = Field(
        default=None, description="NATS credentials file", json_schema_extra=EXISTING_FILE
    )
    nats_tls_ca: FilePath | None = Field(
        default=None, description="CA bundle for NATS TLS", json_schema_extra=EXISTING_FILE
    )
    namespace: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_-]*$",
        json_schema_extra={"accepted": "letters, digits, '_' and '-' only (or empty)"},
    )

    @field_validator("nats_url")
    @classmethod
    def _servers_given(cls, value: str | None) -> str | None:
        if value is not None:
            for url in split_servers(value):
                if not _NATS_URL.match(url):
                    raise ValueError(f"{url!r} is not a nats://, tls://, ws:// or wss:// URL")
        return value

    def nats_servers(self) -> list[str]:
        """The server list (`RUNFLEET_NATS_URL` may name a cluster's servers, comma-separated)."""
        servers = split_servers(self.effective_nats_url())
        from_file = not self.nats_url and (self.data / NATS_URL_FILE).is_file()
        if from_file and not (servers and all(_NATS_URL.match(url) for url in servers)):
            # The fleet's file, not a setting: an empty or mangled one is said as such (found by
            # an operator walkthrough: `internal`, blaming RUNFLEET_NATS_URL, which was unset).
            path = (self.data / NATS_URL_FILE).resolve()
            shown = self.effective_nats_url()[:80]
            raise NatsUnavailable(
                f"{path} holds no NATS URL ({shown!r}); `runfleet up` writes it while its"
                " fleet runs",
                remedy="start `runfleet up` again on this data dir (it rewrites the file);"
                f" if no fleet runs here, remove {path}",
            )
        if not servers:
            raise ValueError(f"no server in RUNFLEET_NATS_URL {self.nats_url!r}")
        return servers

    def effective_nats_url(self) -> str:
        if self.nats_url:
            return self.nats_url
        url_file = self.data / NATS_URL_FILE
        if url_file.is_file():
            return url_file.read_text().strip()
        return "nats://127.0.0.1:4222"


class WireSettings(NatsSettings):
    """Everything of the wire contract (SPEC §3): the streams, the consumer, publishing."""

    stream_replicas: int = Field(default=1, ge=1, le=5)
    max_deliver: int = Field(default=10, ge=2)
    lease_ttl: PositiveDuration = timedelta(seconds=30)
    lease_skew: Duration = timedelta(seconds=2)
    ack_wait: PositiveDuration | None = Field(default=None, description="default lease TTL + skew")
    duplicate_window: PositiveDuration = timedelta(minutes=5)
    publish_timeout: PositiveDuration = timedelta(seconds=2)
    publish_attempts: int = Field(
        default=10,
        ge=1,
        description="tries of one publish; with the doubling waits (0.1 s up to 2 s) ten span"
        " ≈ 11 s, past a cluster's leader election (3.5-8.5 s measured); the retry budget"
        " bounds them too",
    )
    publish_retry_budget: PositiveDuration = timedelta(seconds=20)
    sweeper_grace: PositiveDuration = timedelta(seconds=60)
    sweeper_interval: PositiveDuration = timedelta(seconds=30)
    delivery_log_ttl: Duration = Field(
        default=timedelta(days=7),
        gt=timedelta(0),
        description="max age of the delivery log (SPEC v2.2 §10b)",
    )

    @model_validator(mode="after")
    def _relations(self) -> WireSettings:
        """SPEC §12's relations, each naming the variables it relates."""
        budget, grace = env_name("publish_retry_budget"), env_name("sweeper_grace")
        if self.publish_retry_budget >= self.sweeper_grace:
            raise SettingsRelation(
                ("publish_retry_budget", "sweeper_grace"),
                f"{budget} must be shorter than {grace} (else the sweeper republishes while a"
                " publish is still being retried)",
                f"lower {budget} below {format_duration(self.sweeper_grace)}, or raise {grace}"
                f" above {format_duration(self.publish_retry_budget)}",
            )
        floor = self.lease_ttl + self.lease_skew
        if self.ack_wait is not None and self.ack_wait < floor:
            ack, ttl, skew = (env_name(f) for f in ("ack_wait", "lease_ttl", "lease_skew"))
            raise SettingsRelation(
                ("ack_wait", "lease_ttl", "lease_skew"),
                f"{ack} must be at least {ttl} + {skew} ({format_duration(floor)})",
                f"raise {ack} to {format_duration(floor)} or more, or unset it (default"
                f" {ttl} + {skew})",
            )
        window, interval = env_name("duplicate_window"), env_name("sweeper_interval")
        if self.duplicate_window <= self.sweeper_grace + self.sweeper_interval:
            least = format_duration(self.sweeper_grace + self.sweeper_interval)
            raise SettingsRelation(
                ("duplicate_window", "sweeper_grace", "sweeper_interval"),
                f"{window} must outlast {grace} + {interval} ({least})",
                f"raise {window} above {least}, or lower {grace} or {interval}",
            )
        return self

    @property
    def effective_ack_wait(self) -> timedelta:
        return self.ack_wait or self.lease_ttl + self.lease_skew
