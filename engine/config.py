"""Engine settings (SPEC §5.4, §7, §12), read once from `RUNFLEET_*` variables."""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field, field_validator, model_validator

from engine.lease import LeaseTiming
from store.settings import (
    RunfleetSettings,
    SettingsRelation,
    duration_at_most,
    env_name,
    format_duration,
)
from store.sizes import Size, format_size
from store.timeutil import Duration, PositiveDuration

UNCOMPRESSED_PER_CAP = 8
"""The default bound of a sandbox scratch's plain tar (`RUNFLEET_SCRATCH_MAX_UNCOMPRESSED`), as a
multiple of the compressed cap: 2 GiB at the default 256 MiB. A scratch that is not a host
directory reaches the host as a plain tar first (`Sandbox.copy_out`); only its re-pack meets the
compressed cap, so without this bound a huge or hostile scratch fills the runner's disk before
any cap applies. Gzip level 1 shrinks a mixed tree about 2x (docs/performance.md §6: 39.6 MiB
to 21.2 MiB), text and logs up to about 10x: a mixed scratch at 8x the cap would pass the cap
four times over, so the bound refuses early what the cap would refuse late, while the host
holds at most the tar, its extraction and the archive, about 2 x 8 + 1 = 17 caps per bank in
flight. A scratch that compresses more than 8x (logs, zeros) is the case for setting the
variable. A multiple by default, not a fixed size, so raising `RUNFLEET_SCRATCH_CAP` alone
raises both."""


class EngineSettings(RunfleetSettings):
    sandbox: str = Field(
        default="local",
        description="default sandbox driver",
        json_schema_extra={"accepted": "a sandbox driver name: local or kubernetes"},
    )
    scratch_cap: Size = Field(default=256 * 1024 * 1024, description="bank cap, bytes")
    scratch_max_uncompressed: Size | None = Field(
        default=None,
        ge=1,
        description=f"a pod scratch's plain tar, default {UNCOMPRESSED_PER_CAP} x the bank cap",
        json_schema_extra={"accepted": "a positive size such as 2GiB, 1GB or plain bytes"},
    )
    output_cap: Size = Field(default=1024 * 1024, ge=1, description="a node's stored output")
    output_spill_max: Size = Field(
        default=64 * 1024 * 1024,
        ge=1,
        description="the largest tool output spilled to the blob store (held in memory once)",
    )
    output_events_max: Size = Field(
        default=1024 * 1024,
        ge=1,
        description="a node run's output (stdout and stderr) kept as node_output events",
    )
    lease_ttl: PositiveDuration = timedelta(seconds=30)
    lease_interval: PositiveDuration = timedelta(seconds=10)
    lease_skew: Duration = timedelta(seconds=2)
    lease_loss_margin: PositiveDuration | None = Field(default=None, description="default TTL/6")
    node_cancel_budget: PositiveDuration = timedelta(minutes=1)
    teardown_budget: PositiveDuration = timedelta(minutes=5)
    scratch_bank_budget: PositiveDuration = timedelta(minutes=4)
    post_engine_budget: PositiveDuration = timedelta(minutes=1)
    unwind_margin: Duration = timedelta(seconds=30)

    @field_validator("sandbox")
    @classmethod
    def _known_driver(cls, value: str) -> str:
        from engine.sandbox.registry import driver_names  # the registry reads these settings

        if value not in driver_names():
            raise ValueError(f"unknown sandbox driver {value!r}")
        return value

    @model_validator(mode="after")
    def _relations(self) -> EngineSettings:
        """SPEC §12's relations, each naming the variables it relates."""
        t = self.lease_timing()
        ttl, interval, margin = (
            env_name(f) for f in ("lease_ttl", "lease_interval", "lease_loss_margin")
        )
        if t.interval * 3 > t.ttl:
            raise SettingsRelation(
                ("lease_interval", "lease_ttl"),
                f"{interval} must be at most {ttl}/3",
                f"lower {interval} to {format_duration(t.ttl / 3)} or less, or raise {ttl} to"
                f" {format_duration(t.interval * 3)} or more",
            )
        if t.loss_margin > t.ttl - 2 * t.interval:
            raise SettingsRelation(
                ("lease_loss_margin", "lease_ttl", "lease_interval"),
                f"{margin} must be at most {ttl} - 2 x {interval}",
                f"lower {margin} to {format_duration(t.ttl - 2 * t.interval)} or less, or unset"
                f" it (default {ttl}/6)",
            )
        if self.scratch_uncompressed_bound < self.scratch_cap:
            bound, cap = env_name("scratch_max_uncompressed"), env_name("scratch_cap")
            raise SettingsRelation(
                ("scratch_max_uncompressed", "scratch_cap"),
                f"{bound} must be at least {cap} (the cap counts the gzip of that tar: a lower"
                " bound would make the cap unreachable)",
                f"raise {bound} to {format_size(self.scratch_cap)} or more, or unset it (default"
                f" {UNCOMPRESSED_PER_CAP} x {cap})",
            )
        duration_at_most(
            self, "scratch_bank_budget", "teardown_budget", "the bank is part of the teardown"
        )
        return self

    def lease_timing(self) -> LeaseTiming:
        return LeaseTiming(
            ttl=self.lease_ttl,
            interval=self.lease_interval,
            skew=self.lease_skew,
            loss_margin=self.lease_loss_margin or self.lease_ttl / 6,
        )

    @property
    def scratch_uncompressed_bound(self) -> int:
        """What a bank lets a sandbox's `copy_out` write to the host before it is cut off."""
        if self.scratch_max_uncompressed is not None:
            return self.scratch_max_uncompressed
        return UNCOMPRESSED_PER_CAP * self.scratch_cap

    @property
    def unwind_ceiling(self) -> timedelta:
        """Derived, never set by hand (SPEC §5.4): cancel → return, then return → release."""
        return (
            self.node_cancel_budget
            + self.unwind_margin
            + self.teardown_budget
            + self.post_engine_budget
            + self.unwind_margin
        )
