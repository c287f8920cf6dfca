"""Staged-upload records behave alike on every run store (SPEC §8, §9)."""

from __future__ import annotations

import pytest

from store import RunStore, utcnow
from store.errors import UploadAlreadyExists
from store.models import StagedUpload


async def test_a_duplicate_staged_upload_is_the_same_typed_error_on_every_store(
    run_store: RunStore,
) -> None:
    record = StagedUpload(id="0" * 32, tenant="acme", created_at=utcnow())
    await run_store.put_staged_upload(record)

    with pytest.raises(UploadAlreadyExists) as caught:
        await run_store.put_staged_upload(record)

    assert caught.value.code == "upload_exists"
    assert await run_store.get_staged_upload(record.id, "acme") == record
    assert await run_store.get_staged_upload(record.id, "other") is None
