"""Where the data lives (SPEC §12): `RUNFLEET_DATA` is the embedded default's home, and explicit
`RUNFLEET_STORE_URL` / `RUNFLEET_BLOB_URL` override it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from pydantic import Field

from store.settings import DataDir, RunfleetSettings
from store.sizes import Size
from store.timeutil import Duration


class StoreSettings(RunfleetSettings):
    data: DataDir = Field(default=Path(".runfleet"), description="embedded default's home")
    store_url: str | None = Field(
        default=None,
        description="default sqlite:///$DATA/runs.db",
        pattern=r"^(sqlite:///.+|mongodb(\+srv)?://.+)$",
        json_schema_extra={
            "accepted": "sqlite:///relative/path.db (three slashes: relative to the current "
            "directory), sqlite:////absolute/path.db (four slashes) or mongodb://host/db"
        },
    )
    blob_url: str | None = Field(
        default=None,
        description="default file://$DATA/blobs",
        pattern=r"^(file://.+|s3://.+)$",
        json_schema_extra={"accepted": "file:///path or s3://bucket/prefix"},
    )
    tenant: str = Field(default="default", min_length=1)
    attachment_max_bytes: Size = Field(
        default=50 * 1024 * 1024, ge=0, description="one attachment file's bytes (SPEC §8)"
    )
    attachments_max_count: int = Field(default=32, ge=0, description="attachments per run (§8)")
    upload_ttl: Duration = Field(
        default=timedelta(hours=24), description="a staged upload not promoted is reaped after"
    )

    @property
    def effective_store_url(self) -> str:
        return self.store_url or f"sqlite:///{self.data.resolve() / 'runs.db'}"

    @property
    def effective_blob_url(self) -> str:
        return self.blob_url or f"file://{self.data.resolve() / 'blobs'}"
