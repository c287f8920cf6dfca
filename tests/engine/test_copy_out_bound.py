"""A copy out's bound (docs/reliability.md, "A second review": the bank's host temp), on the real
local sandbox: the plain tar a scratch is copied out as is cut as it passes `max_bytes`, so a
huge (or hostile) scratch costs the host at most the bound, and the bank records it
`unbankable` exactly as one over its compressed cap (SPEC §7.3).

Huge scratches are sparse files: the tar reads (and would write) every byte of them, the
sandbox's disk holds none."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import UNCOMPRESSED_PER_CAP, EngineSettings
from engine.sandbox import LocalSandbox, LocalSandboxDriver, SandboxCopyFailed, SandboxSpec
from engine.sandbox.errors import SandboxCopyTooLarge
from engine.scratch import ScratchBank
from store.blobs_fs import FilesystemBlobStore
from store.settings import SettingsInvalid
from tests.engine.bank_doubles import Records, Said

HUGE = 64 * 1024 * 1024
"""A sparse file the tar reads in full: 64 MiB of stream, no disk."""
BOUND = 1024 * 1024
ONE_WRITE = 64 * 1024
"""The most a single write of `tarfile` (a 16 KiB data block, a header, the end blocks) or a
chunk of the exec stream can carry past the bound before it is refused."""


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[LocalSandbox]:
    driver = LocalSandboxDriver(tmp_path / "data", kill_grace_s=0.5)
    spec = SandboxSpec(
        run_id=f"run-{uuid.uuid4().hex}",
        lease_token="t1",
        workspace_dir=tmp_path / "workspace",
        scratch_dir=tmp_path / "scratch",
        setup_timeout_s=30.0,
    )
    started = await driver.start(spec)
    try:
        yield started
    finally:
        await started.stop()


def _huge_dir(root: Path, size: int = HUGE) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "small.txt").write_text("kept\n")
    with (root / "huge.bin").open("wb") as f:
        f.truncate(size)
    return root


async def test_copy_out_past_its_bound_stops_streaming_and_leaves_no_partial_file(
    sandbox: LocalSandbox, tmp_path: Path
) -> None:
    _huge_dir(sandbox.spec.workspace_dir / "big")
    dest = tmp_path / "host" / "big.tar"
    dest.parent.mkdir()
    with pytest.raises(SandboxCopyTooLarge) as caught:
        await sandbox.copy_out(Path("big"), dest, max_bytes=BOUND)
    exc = caught.value
    assert isinstance(exc, SandboxCopyFailed)  # a copy failure, to a caller that knows no more
    assert exc.code == "sandbox_copy_too_large" and exc.max_bytes == BOUND
    assert BOUND < exc.received <= BOUND + ONE_WRITE  # cut at the write that passed it
    assert "passed its bound of 1048576 bytes" in str(exc)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


async def test_copy_out_bound_is_inclusive_and_no_bound_copies_everything(
    sandbox: LocalSandbox, tmp_path: Path
) -> None:
    """The bound refuses only what passes it: a tar of exactly `max_bytes` is copied whole (the
    bound is the most the host file may hold, not a margin below it)."""
    _huge_dir(sandbox.spec.workspace_dir / "d", size=300_000)
    whole = tmp_path / "whole.tar"
    await sandbox.copy_out(Path("d"), whole)
    size = whole.stat().st_size
    assert size > 300_000
    exact = tmp_path / "exact.tar"
    await sandbox.copy_out(Path("d"), exact, max_bytes=size)
    assert exact.read_bytes() == whole.read_bytes()
    with pytest.raises(SandboxCopyTooLarge):
        await sandbox.copy_out(Path("d"), tmp_path / "short.tar", max_bytes=size - 1)
    assert not (tmp_path / "short.tar").exists()


class _Counting:
    """The real sandbox, counting the copies out the bank asks of it."""

    def __init__(self, inner: LocalSandbox) -> None:
        self.inner = inner
        self.copies = 0

    async def copy_out(self, src: Path, dest_tar: Path, *, max_bytes: int | None = None) -> None:
        self.copies += 1
        await self.inner.copy_out(src, dest_tar, max_bytes=max_bytes)


def _bank(
    tmp_path: Path, scratch: Path, *, cap: int, bound: int | None
) -> tuple[ScratchBank, Records, Said, FilesystemBlobStore]:
    records, said = Records(), Said()
    blobs = FilesystemBlobStore(tmp_path / "blobs")
    bank = ScratchBank(
        run_id="r1",
        token="t1",
        blobs=blobs,
        writer=records,  # type: ignore[arg-type]
        events=said,  # type: ignore[arg-type]
        cap_bytes=cap,
        budget_s=30,
        host_scratch=tmp_path / "no-host-scratch",
        sandbox_scratch=scratch,
        max_uncompressed_bytes=bound,
    )
    return bank, records, said, blobs


def _said_banked(said: Said) -> dict[str, Any]:
    [(kind, data)] = said.said
    assert kind == "sandbox_scratch_banked"
    return data


async def test_a_scratch_past_the_uncompressed_bound_is_recorded_unbankable_as_one_over_the_cap(
    sandbox: LocalSandbox, tmp_path: Path
) -> None:
    """The outcome is the compressed cap's (`unbankable`, "over the cap", nothing uploaded, so a
    resume is refused `SCRATCH_NOT_PORTABLE` until the loss is accepted), reached on the first
    copy: the same scratch would pass the bound again, so no retry spends the bank budget."""
    incompressible = sandbox.spec.workspace_dir / "incompressible"
    incompressible.mkdir(parents=True)
    (incompressible / "noise.bin").write_bytes(os.urandom(200_000))
    over_cap, cap_records, cap_said, _ = _bank(
        tmp_path / "a", incompressible.absolute(), cap=50_000, bound=None
    )
    capped = await over_cap.bank(
        _Counting(sandbox),  # type: ignore[arg-type]
        host_dir=False,
        process_isolated=True,
        progress=4,
    )

    huge = _huge_dir(sandbox.spec.workspace_dir / "huge").absolute()
    past, records, said, blobs = _bank(tmp_path / "b", huge, cap=1 << 20, bound=BOUND)
    counting = _Counting(sandbox)
    bounded = await past.bank(
        counting,  # type: ignore[arg-type]
        host_dir=False,
        process_isolated=True,
        progress=4,
    )

    assert counting.copies == 1
    assert (capped.state, bounded.state) == ("unbankable", "unbankable")
    assert capped.reason.startswith("over the cap: ") and bounded.reason.startswith(
        "over the cap: "
    )
    assert "passed its bound of 1048576 bytes uncompressed" in bounded.reason
    assert "RUNFLEET_SCRATCH_MAX_UNCOMPRESSED" in bounded.reason
    assert BOUND < bounded.bytes <= BOUND + ONE_WRITE
    [cap_record], [record] = cap_records.records, records.records
    shape = ("state", "key", "progress", "unquiesced", "raced")
    assert {k: record[k] for k in shape} == {k: cap_record[k] for k in shape}
    assert record["state"] == "unbankable" and record["key"] is None
    event, cap_event = _said_banked(said), _said_banked(cap_said)
    assert not event["banked"] and not event["empty"] and not event["unknown"]
    assert (event["banked"], event["empty"], event["unknown"]) == (
        cap_event["banked"],
        cap_event["empty"],
        cap_event["unknown"],
    )
    assert event["reason"] == bounded.reason
    assert await blobs.list("runs/") == []


def test_the_uncompressed_bound_defaults_to_a_multiple_of_the_cap_and_never_below_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in [k for k in os.environ if k.startswith("RUNFLEET_")]:
        monkeypatch.delenv(key)
    default = EngineSettings()
    assert default.scratch_uncompressed_bound == UNCOMPRESSED_PER_CAP * default.scratch_cap
    monkeypatch.setenv("RUNFLEET_SCRATCH_CAP", "1GiB")
    assert EngineSettings().scratch_uncompressed_bound == UNCOMPRESSED_PER_CAP * 1024**3
    monkeypatch.setenv("RUNFLEET_SCRATCH_MAX_UNCOMPRESSED", "20GiB")
    assert EngineSettings().scratch_uncompressed_bound == 20 * 1024**3
    monkeypatch.setenv("RUNFLEET_SCRATCH_MAX_UNCOMPRESSED", "512MiB")
    with pytest.raises(SettingsInvalid) as caught:
        EngineSettings()
    exc = caught.value
    assert exc.names == ("RUNFLEET_SCRATCH_MAX_UNCOMPRESSED", "RUNFLEET_SCRATCH_CAP")
    assert "RUNFLEET_SCRATCH_MAX_UNCOMPRESSED=512MiB" in exc.message
    assert exc.remedy is not None and "1GiB or more" in exc.remedy
    monkeypatch.setenv("RUNFLEET_SCRATCH_MAX_UNCOMPRESSED", "0")
    with pytest.raises(SettingsInvalid, match="expected a positive size"):
        EngineSettings()


def test_the_bank_copies_out_under_the_bound_its_settings_give(tmp_path: Path) -> None:
    """An execution's bank takes the setting; a bank built without one still has the default
    multiple of its cap, never no bound at all."""
    from types import SimpleNamespace

    from engine.scratch_steps import _bank as bank_of

    settings = EngineSettings(scratch_cap=1000, scratch_max_uncompressed=12_345)
    execution = SimpleNamespace(
        settings=settings,
        run_id="r1",
        token="t1",
        blobs=None,
        writer=Records(),
        events=Said(),
        scratch=tmp_path / "scratch",
    )
    assert bank_of(execution).max_uncompressed_bytes == 12_345  # type: ignore[arg-type]
    bare = ScratchBank(
        run_id="r1",
        token="t1",
        blobs=None,
        writer=Records(),  # type: ignore[arg-type]
        events=Said(),  # type: ignore[arg-type]
        cap_bytes=1000,
        budget_s=1,
        host_scratch=tmp_path / "scratch",
    )
    assert bare.max_uncompressed_bytes == UNCOMPRESSED_PER_CAP * 1000
