"""Where the data lives (SPEC §12): `RUNFLEET_DATA` is the embedded default's home, and explicit
`RUNFLEET_STORE_URL` / `RUNFLEET_BLOB_URL` override it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUNFLEET_", extra="ignore")

    data: Path = Field(default=Path(".runfleet"), description="embedded default's home")
    store_url: str | None = Field(default=None, description="default sqlite:///$DATA/runs.db")
    blob_url: str | None = Field(default=None, description="default file://$DATA/blobs")
    tenant: str = Field(default="default", min_length=1)

    @property
    def effective_store_url(self) -> str:
        return self.store_url or f"sqlite:///{self.data.resolve() / 'runs.db'}"

    @property
    def effective_blob_url(self) -> str:
        return self.blob_url or f"file://{self.data.resolve() / 'blobs'}"
