"""Where the data lives (SPEC §12): `RUNFLEET_DATA` is the embedded default's home, and explicit
`RUNFLEET_STORE_URL` / `RUNFLEET_BLOB_URL` override it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from store.settings import DataDir, RunfleetSettings


class StoreSettings(RunfleetSettings):
    data: DataDir = Field(default=Path(".runfleet"), description="embedded default's home")
    store_url: str | None = Field(
        default=None,
        description="default sqlite:///$DATA/runs.db",
        pattern=r"^(sqlite:///.+|mongodb(\+srv)?://.+)$",
        json_schema_extra={"accepted": "sqlite:///path or mongodb://host/db"},
    )
    blob_url: str | None = Field(
        default=None,
        description="default file://$DATA/blobs",
        pattern=r"^(file://.+|s3://.+)$",
        json_schema_extra={"accepted": "file:///path or s3://bucket/prefix"},
    )
    tenant: str = Field(default="default", min_length=1)

    @property
    def effective_store_url(self) -> str:
        return self.store_url or f"sqlite:///{self.data.resolve() / 'runs.db'}"

    @property
    def effective_blob_url(self) -> str:
        return self.blob_url or f"file://{self.data.resolve() / 'blobs'}"
