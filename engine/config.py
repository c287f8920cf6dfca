"""Engine settings (SPEC §5.4, §7, §12), read once from `RUNFLEET_*` variables."""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.lease import LeaseTiming
from store.timeutil import Duration


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUNFLEET_", extra="ignore")

    sandbox: str = Field(default="local", description="default sandbox driver")
    scratch_cap: int = Field(default=256 * 1024 * 1024, description="bank cap, bytes")
    output_cap: int = Field(default=1024 * 1024, description="a node's stored output, bytes")
    lease_ttl: Duration = timedelta(seconds=30)
    lease_interval: Duration = timedelta(seconds=10)
    lease_skew: Duration = timedelta(seconds=2)
    lease_loss_margin: Duration | None = Field(default=None, description="default TTL/6")
    node_cancel_budget: Duration = timedelta(minutes=1)
    teardown_budget: Duration = timedelta(minutes=5)
    scratch_bank_budget: Duration = timedelta(minutes=4)
    post_engine_budget: Duration = timedelta(minutes=1)
    unwind_margin: Duration = timedelta(seconds=30)

    @model_validator(mode="after")
    def _relations(self) -> EngineSettings:
        self.lease_timing().check()
        if self.scratch_bank_budget > self.teardown_budget:
            raise ValueError("RUNFLEET_SCRATCH_BANK_BUDGET must fit in RUNFLEET_TEARDOWN_BUDGET")
        return self

    def lease_timing(self) -> LeaseTiming:
        return LeaseTiming(
            ttl=self.lease_ttl,
            interval=self.lease_interval,
            skew=self.lease_skew,
            loss_margin=self.lease_loss_margin or self.lease_ttl / 6,
        )

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
