"""`open_store(sqlite:///…)` checks the URL before creating anything (SPEC §12): a typo in an
explicit URL is `InvalidStoreUrl`, never a new empty store; only the embedded default
(`parents=True`) has its directory made."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.errors import InvalidStoreUrl
from store.url import open_store


async def test_open_store_refuses_a_missing_directory_and_creates_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nonexistent' / 'dir' / 'runs.db'}"
    with pytest.raises(InvalidStoreUrl) as raised:
        await open_store(url)
    assert str(tmp_path / "nonexistent" / "dir" / "runs.db") in raised.value.message
    assert raised.value.message.startswith(f"{url}: ")
    assert raised.value.remedy is not None and "sqlite:////absolute/path.db" in raised.value.remedy
    assert not (tmp_path / "nonexistent").exists()


async def test_open_store_without_create_refuses_a_missing_file_and_creates_nothing(
    tmp_path: Path,
) -> None:
    store = tmp_path / "runs.db"
    with pytest.raises(InvalidStoreUrl, match=f"no store exists at {store}"):
        await open_store(f"sqlite:///{store}", create=False)
    assert not store.exists()


async def test_open_store_without_create_opens_an_existing_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    await (await open_store(url)).close()
    await (await open_store(url, create=False)).close()


async def test_open_store_refuses_a_directory_as_the_store_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidStoreUrl, match="is a directory"):
        await open_store(f"sqlite:///{tmp_path}")


async def test_open_store_with_parents_makes_the_embedded_default_directory(
    tmp_path: Path,
) -> None:
    store = tmp_path / "fresh" / "data" / "runs.db"
    await (await open_store(f"sqlite:///{store}", parents=True)).close()
    assert store.is_file()
