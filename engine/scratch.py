"""The scratch bank and its restore (SPEC v2.2 §7.2b-§7.5), written once against the
`SandboxDriver`/`Sandbox` and `BlobStore` protocols, never per driver (STYLE.md).

A resume lands on a new sandbox, often on another host. Unless every runner that may claim the
run reaches the same directory (`deployment_host_backed`), the scratch a node left behind is
banked at teardown and restored before the next execution's first node; what cannot be restored
is refused rather than lost silently. The order of a bank (adr/0011): tar + gzip at
`BANK_GZIP_LEVEL` through a host temp file, the cap checked before any byte is uploaded, upload
to the execution's own key, the fenced record naming that key, *then* every other key under the
prefix deleted, so at every instant the record names a key that exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import logging
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal

from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from engine.archive import (
    ArchiveOverBound,
    ArchiveOverCap,
    ArchiveRefused,
    check_archive,
    make_archive,
)
from engine.config import UNCOMPRESSED_PER_CAP
from engine.events import EventLog
from engine.failures import FailureCode
from engine.fencing import FencedWriter, LeaseLost
from engine.outcome import Failed
from engine.sandbox.errors import SandboxArchiveInvalid, SandboxCopyTooLarge, SandboxError
from engine.sandbox.protocols import Sandbox
from engine.workflow import SANDBOX_KINDS
from store import (
    BlobNotFound,
    BlobStore,
    Checkpoint,
    EventDraft,
    RunNotFound,
    RunStore,
    ScratchRecord,
    StoreError,
    lease_is_free,
    utcnow,
)

log = logging.getLogger(__name__)

__all__ = [
    "BANK_GZIP_LEVEL",
    "BankOutcome",
    "ScratchBank",
    "bank_key",
    "bank_prefix",
    "counts_for_bank",
    "deployment_host_backed",
    "host_backed_of",
    "moved_past",
    "sweep_bank_keys",
    "sweep_orphan_banks",
]

BANK_GZIP_LEVEL = 1
"""gzip level of every bank: about 2.5 times faster than `tar czf`'s default 6 on a mixed
tree for ~15 % more bytes (adr/0011, docs/performance.md)."""

RACE_RETRIES = 3
"""Tars run again after a member raced, while the bank budget allows."""

_RANK = {"unknown": 0, "unbankable": 0, "empty": 1, "banked": 2}
"""files > empty > unknown: a later try never records less (§7.3)."""

_TRANSIENT = (StoreError, OSError, SandboxError)


def _transient(exc: BaseException) -> bool:
    """Worth another try within the budget. A scratch past the copy's bound is not: the same
    scratch passes it again, so it is recorded at once, as one over the cap is."""
    return isinstance(exc, _TRANSIENT) and not isinstance(exc, SandboxCopyTooLarge)


class _NoBlobStore(Exception):
    """Nowhere to bank a non-empty scratch: not transient, recorded `unbankable` at once."""


def deployment_host_backed(driver: str, store_url: str, blob_url: str | None) -> bool:
    """SPEC v2.2 §7.2b: the scratch is host-backed only when every runner that may claim the run
    reaches it — the local driver on the embedded default (a SQLite store, which pins the
    deployment to one host, with file blobs or none). Anything else banks, the local driver on
    Mongo or S3 included."""
    file_blobs = blob_url is None or blob_url.startswith("file://")
    return driver == "local" and store_url.startswith("sqlite:///") and file_blobs


def host_backed_of(driver: str, store: RunStore, blobs: BlobStore | None) -> bool:
    """`deployment_host_backed` read from the opened backends (their URLs, as the objects know
    them), for a runner handed objects rather than URLs. Decided once, at start."""
    from store.blobs_fs import FilesystemBlobStore
    from store.sqlite.runs import SqliteRunStore

    store_url = f"sqlite:///{store.path}" if isinstance(store, SqliteRunStore) else "remote://"
    if blobs is None or isinstance(blobs, FilesystemBlobStore):
        blob_url = None if blobs is None else f"file://{blobs.root}"
    else:
        blob_url = "remote://"
    return deployment_host_backed(driver, store_url, blob_url)


def counts_for_bank(kind: str) -> bool:
    """A finished node of this kind moves the run past its bank (`SANDBOX_KINDS`, §7.4)."""
    return kind in SANDBOX_KINDS


def bank_prefix(run_id: str) -> str:
    return f"runs/{run_id}/scratch/"


def bank_key(run_id: str, lease_token: str) -> str:
    return f"{bank_prefix(run_id)}{lease_token}.tgz"


def moved_past(checkpoint: Checkpoint, rec: ScratchRecord) -> bool:
    """§7.4: a sandbox node (`SANDBOX_KINDS`) finished after the bank's checkpoint; nodes a
    rewind dropped (no longer `completed`) do not count, engine-side nodes never do."""
    if checkpoint.sandbox_done:
        done = checkpoint.sandbox_done
        return any(done[n] > rec.progress for n in checkpoint.completed if n in done)
    return checkpoint.sandbox_progress > rec.progress


async def sweep_bank_keys(blobs: BlobStore, run_id: str, keep: str | None) -> list[str]:
    """Deletes every key under the run's bank prefix except `keep` (the one the record names);
    the bank's writer after each record, the sweeper and `gc` for runs with no live lease."""
    deleted = []
    for info in await blobs.list(bank_prefix(run_id)):
        if info.key != keep and await blobs.delete(info.key):
            deleted.append(info.key)
    return deleted


async def sweep_orphan_banks(store: RunStore, blobs: BlobStore, skew: timedelta) -> int:
    """§7.3 cleanup (the sweeper and `gc`): for every run with bank keys and no live lease,
    delete the keys its record does not name (an upload whose record never landed, a writer
    that died before its own sweep; every key of a run that no longer exists).

    The key of the lease the run holds is kept even when the lease looks free: "free" is read
    on this process's clock, and a sweeper whose clock ran ahead of the holder's deleted a bank
    just uploaded, before its execution's record landed; the next resume then found the record
    naming a missing file (a clocks review). That key becomes an orphan only when another
    claim replaces the token, and the next pass takes it."""
    runs: dict[str, list[str]] = {}
    for info in await blobs.list("runs/"):
        parts = info.key.split("/")
        if len(parts) == 4 and parts[2] == "scratch":
            runs.setdefault(parts[1], []).append(info.key)
    deleted = 0
    for run_id, keys in runs.items():
        try:
            run = await store.get_run(run_id)
        except RunNotFound:
            keep = None
        else:
            if not lease_is_free(run, utcnow(), skew):
                continue  # its execution banks and sweeps for itself
            keep = run.scratch.key if run.scratch is not None else None
            if run.lease is not None:
                keys = [k for k in keys if k != bank_key(run_id, run.lease.token)]
        for key in keys:
            if key != keep and await blobs.delete(key):
                deleted += 1
    return deleted


@dataclass(slots=True)
class BankOutcome:
    """What a bank did: the event's fields plus the duration (for the metrics)."""

    state: Literal["banked", "empty", "unbankable", "unknown", "dropped", "none"]
    bytes: int = 0
    reason: str = ""
    raced: list[str] = field(default_factory=list)
    unquiesced: bool = False
    seconds: float = 0.0

    def event(self) -> dict[str, object]:
        return {
            "banked": self.state == "banked",
            "empty": self.state == "empty",
            "unknown": self.state == "unknown",
            "bytes": self.bytes,
            "reason": self.reason,
            "raced": self.raced,
            "unquiesced": self.unquiesced,
            "seconds": round(self.seconds, 3),
        }


@contextlib.contextmanager
def _host_temp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="runfleet-scratch-") as tmp:
        yield Path(tmp)


def remove_tree(path: Path) -> None:
    """`shutil.rmtree`, through directories a node made read-only (a Go module cache, `chmod
    -R a-w`): a runner that is not root could not empty such a scratch, and its restore was
    retried as transient for good (found by a review). A directory refused is made writable
    by its owner, then the removal tried again."""

    def writable_then_again(func: Callable[..., object], name: str, exc: object) -> None:
        parent = os.path.dirname(name)
        for target in (parent, name):
            with contextlib.suppress(OSError):
                os.chmod(target, os.stat(target).st_mode | stat.S_IRWXU)
        func(name)

    if path.is_symlink() or not path.exists():
        path.unlink(missing_ok=True)
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=writable_then_again)
    else:
        shutil.rmtree(path, onerror=writable_then_again)


def _empty_dir(path: Path) -> None:
    remove_tree(path)
    path.mkdir(parents=True, exist_ok=True)


def _gunzip(src: Path, dest: Path) -> None:
    """The bank as a plain tar for `copy_in`. `check_archive` read the same file to its trailer
    first; a stream that still does not decompress is the bank's corruption, never a transient
    read (`ArchiveRefused`, as the host-dir path's `safe_extract` says it)."""
    try:
        with gzip.open(src, "rb") as fin, open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1024 * 1024)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ArchiveRefused(f"not a readable gzip tar: corrupt: {exc}") from exc


def _portable(member: tarfile.TarInfo, dest: str, skipped: list[str]) -> tarfile.TarInfo | None:
    """The `data` filter, except that a device, fifo or socket is skipped (named in `skipped`)
    rather than failing the whole copy: what `make_archive` does on a host-backed scratch."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        skipped.append(member.name)
        return None
    return tarfile.data_filter(member, dest)


def _untar(src: Path, dest: Path) -> list[str]:
    """Extracts the plain tar a sandbox's `copy_out` made into `dest`; returns the special
    files it skipped."""
    skipped: list[str] = []
    with tarfile.open(src, "r:") as tar:
        tar.extractall(dest, filter=functools.partial(_portable, skipped=skipped))
    return skipped


class ScratchBank:
    """The bank and restore of one execution's scratch.

    `host_scratch` is the run's scratch on this host; a driver whose scratch *is* that directory
    (`capabilities.host_backed_scratch`, the local driver) is read and written there directly,
    any other through `copy_out` / `copy_in` of `sandbox_scratch` inside the sandbox.

    `max_uncompressed_bytes` bounds that `copy_out`'s plain tar, which lands on this host
    before the compressed `cap_bytes` can apply; the copy is cut as it passes the bound, so a
    huge or hostile scratch costs the host at most the bound, and the scratch is recorded
    `unbankable` exactly as one over the cap (§7.3). `None`: `UNCOMPRESSED_PER_CAP` x the cap,
    `RUNFLEET_SCRATCH_MAX_UNCOMPRESSED`'s default (`engine.config`, where the multiple is
    argued)."""

    def __init__(
        self,
        *,
        run_id: str,
        token: str,
        blobs: BlobStore | None,
        writer: FencedWriter,
        events: EventLog,
        cap_bytes: int,
        budget_s: float,
        host_scratch: Path,
        sandbox_scratch: Path = Path("/scratch"),
        max_uncompressed_bytes: int | None = None,
    ) -> None:
        self.run_id = run_id
        self.token = token
        self.blobs = blobs
        self.writer = writer
        self.events = events
        self.cap_bytes = cap_bytes
        self.budget_s = budget_s
        self.host_scratch = host_scratch
        self.sandbox_scratch = sandbox_scratch
        self.max_uncompressed_bytes = (
            UNCOMPRESSED_PER_CAP * cap_bytes
            if max_uncompressed_bytes is None
            else max_uncompressed_bytes
        )
        self._said = False
        """`sandbox_scratch_banked` rode with a record write of this bank."""
        self._started = 0.0

    # -- teardown --------------------------------------------------------------------------

    async def drop(self) -> None:
        """A finished run keeps no bank: its keys go, the record says nothing is held."""
        if self.blobs is not None:
            await sweep_bank_keys(self.blobs, self.run_id, keep=None)

    async def bank(
        self, sandbox: Sandbox, *, host_dir: bool, process_isolated: bool, progress: int
    ) -> BankOutcome:
        """§7.3, within the bank budget; says `sandbox_scratch_banked` and returns what it did.

        The event rides with the record write it describes (ADR-0014), so a runner killed
        right after the record leaves no bank unnarrated; the sweep of older keys follows it
        (the chaos soak's kills found the window when the sweep came first)."""
        started = time.monotonic()
        deadline = started + self.budget_s
        self._said = False
        self._started = started
        # Not process isolated (local): the node's process groups were killed at node end, so
        # nothing else writes the scratch; an isolated driver's quiesce is its own (§7.1).
        unquiesced = process_isolated
        result = BankOutcome("unknown", unquiesced=unquiesced)
        tried: BankOutcome | None = None
        """The best result whose record write was tried: it may have landed (a reply lost)."""
        recorded = False
        with _host_temp() as tmp:
            archive = tmp / "scratch.tgz"
            try:
                async for attempt in self._retrying(deadline):
                    with attempt:
                        result = await self._tar(sandbox, host_dir, tmp, archive, deadline)
                        result.unquiesced = unquiesced
                        if tried is not None and _RANK.get(result.state, 0) < _RANK[tried.state]:
                            # A later try never replaces a record with less (§7.3): a record
                            # write that raised may have landed, so its result is written
                            # again (its archive, if any, is uploaded under the same key).
                            # The guard could never run before: it was armed only after a
                            # record write succeeded, which ends the retries (an audit).
                            result = tried
                        elif result.state == "banked":
                            assert self.blobs is not None
                            await self.blobs.put_file(bank_key(self.run_id, self.token), archive)
                        tried = result
                        await self._record(result, progress)
                        recorded = True
            except LeaseLost:
                raise
            except ArchiveOverCap as exc:
                result = BankOutcome("unbankable", bytes=exc.written, reason=f"over the cap: {exc}")
                result.unquiesced = unquiesced
                await self._record_quietly(result, progress)
            except SandboxCopyTooLarge as exc:
                reason = f"over the cap: {exc}; the bound is RUNFLEET_SCRATCH_MAX_UNCOMPRESSED"
                result = BankOutcome("unbankable", bytes=exc.received, reason=reason)
                result.unquiesced = unquiesced
                await self._record_quietly(result, progress)
            except ArchiveOverBound as exc:
                reason = f"over the cap: {exc}; the bound is RUNFLEET_SCRATCH_MAX_UNCOMPRESSED"
                result = BankOutcome("unbankable", bytes=exc.plain, reason=reason)
                result.unquiesced = unquiesced
                await self._record_quietly(result, progress)
            except ArchiveRefused as exc:  # a member no restore would take: said, named
                result = BankOutcome("unbankable", reason=f"not bankable: {exc.message}"[:500])
                result.unquiesced = unquiesced
                await self._record_quietly(result, progress)
            except Exception as exc:  # noqa: BLE001 - the budget is spent: say so, record it
                if tried is not None and _RANK[tried.state] > 0:
                    # A record of files or of an empty scratch may have landed: never less.
                    result = tried
                    await self._record_quietly(result, progress)
                elif not recorded:
                    read = result.state != "unknown" or isinstance(exc, _NoBlobStore)
                    state: Literal["unbankable", "unknown"] = "unbankable" if read else "unknown"
                    result = BankOutcome(
                        state, bytes=result.bytes, reason=f"not banked: {exc!r}"[:500]
                    )
                    result.unquiesced = unquiesced
                    if state == "unbankable":
                        await self._record_quietly(result, progress)
                    # unknown (the scratch could not even be read, e.g. its pod is gone): the
                    # previous record stays, so a sandbox node finished since still refuses.
            if recorded and result.state in ("banked", "empty"):
                await self._sweep(result, deadline)
        if not self._said:  # no record carried it (unknown, or a record the store refused)
            result.seconds = time.monotonic() - started
            await self.events.emit("sandbox_scratch_banked", **result.event())
        return result

    async def _sweep(self, result: BankOutcome, deadline: float) -> None:
        """Every bank key but the recorded one goes. Left-over keys cost only space: the next
        bank's sweep, or the finished run's drop, takes them."""
        if self.blobs is None:  # an empty scratch on a deployment with no blob store
            return
        keep = bank_key(self.run_id, self.token) if result.state == "banked" else None
        try:
            async for attempt in self._retrying(deadline):
                with attempt:
                    await sweep_bank_keys(self.blobs, self.run_id, keep=keep)
        except Exception as exc:  # noqa: BLE001 - the record stands; the keys wait for later
            log.warning("run %s: older bank keys not swept (%r)", self.run_id, exc)

    def _retrying(self, deadline: float) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_delay(max(deadline - time.monotonic(), 0.0)) | stop_after_attempt(8),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            reraise=True,
        )

    async def _tar(
        self, sandbox: Sandbox, host_dir: bool, tmp: Path, archive: Path, deadline: float
    ) -> BankOutcome:
        """The archive of the scratch as it is now: tar again while members race and the
        budget allows; the last complete archive is kept with the raced members named."""
        source = self.host_scratch
        if not host_dir:
            source = tmp / "copied"
            _empty_dir(source)
            plain = tmp / "copied.tar"
            await sandbox.copy_out(
                self.sandbox_scratch, plain, max_bytes=self.max_uncompressed_bytes
            )
            skipped = await asyncio.to_thread(_untar, plain, source)
            if skipped:
                log.info(
                    "run %s: %d special file(s) in the sandbox scratch not banked (devices, "
                    "fifos and sockets are skipped, as on a host-backed scratch): %s",
                    self.run_id,
                    len(skipped),
                    ", ".join(skipped[:10]) + (", ..." if len(skipped) > 10 else ""),
                )
        # The tar runs in a thread, which a cancel cannot stop: it looks at `stop` between
        # chunks, set when its time is up (a margin before the budget, so the record and its
        # event still land) or when this task is cancelled.
        stop = threading.Event()
        until = deadline - min(5.0, 0.1 * self.budget_s)

        def stopped() -> bool:
            return stop.is_set() or time.monotonic() >= until

        try:
            for _ in range(RACE_RETRIES + 1):
                stats = await asyncio.to_thread(
                    make_archive,
                    source,
                    archive,
                    level=BANK_GZIP_LEVEL,
                    cap_bytes=self.cap_bytes,
                    max_plain_bytes=self.max_uncompressed_bytes,
                    stop=stopped,
                )
                if not stats.raced or time.monotonic() >= deadline:
                    break
        finally:
            stop.set()
        if stats.empty:
            return BankOutcome("empty")
        if self.blobs is None:
            raise _NoBlobStore("no blob store to bank the scratch into")
        reason = "raced: the last complete archive" if stats.raced else ""
        return BankOutcome("banked", bytes=stats.bytes, raced=list(stats.raced), reason=reason)

    async def _record(self, result: BankOutcome, progress: int) -> None:
        """The fenced record (a new one clears `forsaken`), with `sandbox_scratch_banked`
        riding on it the first time (a retried record says nothing more)."""
        banked = result.state == "banked"
        key = bank_key(self.run_id, self.token) if banked else None
        rec = ScratchRecord(
            state=result.state,
            key=key,
            bytes=result.bytes,
            progress=progress,
            raced=result.raced,
            unquiesced=result.unquiesced,
            lease_token=self.token,
            at=utcnow(),
        )
        said: list[EventDraft] = []
        if not self._said:
            result.seconds = time.monotonic() - self._started
            said.append(self.events.draft("sandbox_scratch_banked", **result.event()))
        await self.writer.write_record({"scratch": rec.model_dump()}, events=said)
        self._said = True

    async def _record_quietly(self, result: BankOutcome, progress: int) -> None:
        with contextlib.suppress(StoreError, OSError):
            await self._record(result, progress)

    # -- restore ---------------------------------------------------------------------------

    async def restore(
        self, sandbox: Sandbox, rec: ScratchRecord, *, host_dir: bool, stale: bool
    ) -> Failed | None:
        """§7.4: the banked archive checked on the host (read to its gzip trailer), then
        extracted into an emptied scratch. Gone, corrupt or refused → `SCRATCH_NOT_PORTABLE`
        (held), on either path (host dir or copy in); a read that broke →
        `SCRATCH_RESTORE_FAILED` (transient). Says `sandbox_scratch_restored`."""
        assert rec.key is not None
        with _host_temp() as tmp:
            archive = tmp / "bank.tgz"
            failed: Failed | None = None
            restored = 0
            try:
                if self.blobs is None:
                    raise BlobNotFound(f"no blob store holds {rec.key}")
                await self.blobs.get_to_file(rec.key, archive)
                await asyncio.to_thread(
                    check_archive,
                    archive,
                    cap_bytes=self.cap_bytes,
                    max_plain_bytes=self.max_uncompressed_bytes,
                )
                restored = await self._extract(sandbox, archive, tmp, host_dir)
            except BlobNotFound as exc:
                failed = Failed(FailureCode.SCRATCH_NOT_PORTABLE, f"the bank is gone: {exc}")
            except (ArchiveRefused, SandboxArchiveInvalid) as exc:  # corrupt or unsafe: held
                failed = Failed(FailureCode.SCRATCH_NOT_PORTABLE, f"the bank is refused: {exc}")
            except (StoreError, OSError, SandboxError) as exc:
                failed = Failed(
                    FailureCode.SCRATCH_RESTORE_FAILED, f"the bank could not be read: {exc}"
                )
        await self.events.emit(
            "sandbox_scratch_restored",
            restored=failed is None,
            bytes=restored,
            stale=stale,
            accepted=False,
            reason="" if failed is None else failed.error,
            key=rec.key,
        )
        return failed

    async def _extract(self, sandbox: Sandbox, archive: Path, tmp: Path, host_dir: bool) -> int:
        from engine.archive import safe_extract

        if host_dir:
            await asyncio.to_thread(_empty_dir, self.host_scratch)
            return await asyncio.to_thread(
                safe_extract,
                archive,
                self.host_scratch,
                cap_bytes=self.cap_bytes,
                max_plain_bytes=self.max_uncompressed_bytes,
            )
        plain = tmp / "bank.tar"
        await asyncio.to_thread(_gunzip, archive, plain)
        await sandbox.copy_in(plain, self.sandbox_scratch)
        return plain.stat().st_size
