"""The scratch bank's cost (SPEC §7.3, issue 14 item 7): bank and restore of a mixed directory
(a copy of part of this venv's site-packages, ~35 MiB) against `tar czf` / `tar xzf` measured
in the same run, on the same tree, on the same disk.

- bank = `make_archive` at `BANK_GZIP_LEVEL` (stat before/after every member) + `put_file` into
  a file blob store (the upload of a real bank; S3 adds the network);
- restore = `get_to_file` + `safe_extract` (`check_archive` first, then the `data` filter);
- the same bank at gzip level 6 (`tar czf`'s default), to name what the level buys.

Target: bank at most 0.5 times the `tar czf` wall. Medians of `--rounds` rounds, printed as a
table and one `SUMMARY bank:` line. `--quick` (a ~2 MiB tree, one round) proves it runs.

    python -m bench.bank [--quick] [--rounds 5] [--mib 35]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.archive import make_archive, safe_extract  # noqa: E402
from engine.scratch import BANK_GZIP_LEVEL  # noqa: E402
from store.blobs_fs import FilesystemBlobStore  # noqa: E402


def build_tree(dest: Path, mib: float) -> tuple[int, int]:
    """Copies whole top-level packages of site-packages until `mib` MiB: (files, bytes)."""
    site = Path(sysconfig.get_paths()["purelib"])
    want = int(mib * 1024 * 1024)
    files = total = 0
    for pkg in sorted(p for p in site.iterdir() if p.is_dir()):
        if total >= want:
            break
        for path in sorted(pkg.rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            target = dest / path.relative_to(site)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            files += 1
            total += path.stat().st_size
    return files, total


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_round(tree: Path, work: Path, blobs: FilesystemBlobStore) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    out: dict[str, float] = {}
    tgz = work / "tar.tgz"
    out["tar czf"] = timed(
        lambda: subprocess.run(["tar", "czf", str(tgz), "-C", str(tree), "."], check=True)
    )
    xdir = work / "tar-x"
    xdir.mkdir()
    out["tar xzf"] = timed(
        lambda: subprocess.run(["tar", "xzf", str(tgz), "-C", str(xdir)], check=True)
    )
    out["tar czf bytes"] = tgz.stat().st_size

    piped = work / "piped.tgz"
    out["tar | gzip -1"] = timed(
        lambda: subprocess.run(
            f"tar cf - -C '{tree}' . | gzip -1 > '{piped}'", shell=True, check=True
        )
    )
    out["tar | gzip -1 bytes"] = piped.stat().st_size
    for level in (BANK_GZIP_LEVEL, 6):
        archive = work / f"bank-{level}.tgz"
        key = f"runs/bench/scratch/level{level}.tgz"

        def tar(archive: Path = archive, level: int = level) -> None:
            make_archive(tree, archive, level=level, cap_bytes=256 * 1024 * 1024)

        def upload(archive: Path = archive, key: str = key) -> None:
            asyncio.run(blobs.put_file(key, archive))

        made, put = timed(tar), timed(upload)
        out[f"bank level {level}"] = made + put
        out[f"archive level {level}"] = made
        out[f"upload level {level}"] = put
        out[f"bank level {level} bytes"] = archive.stat().st_size
    fetched = work / "fetched.tgz"
    rdir = work / "restored"

    def restore() -> None:
        asyncio.run(blobs.get_to_file(f"runs/bench/scratch/level{BANK_GZIP_LEVEL}.tgz", fetched))
        safe_extract(fetched, rdir, cap_bytes=256 * 1024 * 1024)

    out["restore"] = timed(restore)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=float, default=35.0)
    args = parser.parse_args()
    rounds, mib = (1, 2.0) if args.quick else (args.rounds, args.mib)
    with tempfile.TemporaryDirectory(prefix="runfleet-bench-bank-") as tmp:
        base = Path(tmp)
        tree = base / "tree"
        files, size = build_tree(tree, mib)
        blobs = FilesystemBlobStore(base / "blobs")
        results = [run_round(tree, base / "work", blobs) for _ in range(rounds)]
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"tree: {files} files, {size / 1048576:.1f} MiB; {rounds} round(s), medians")
    print(f"load average at the end: {load} (two cores shared with whatever else runs)")
    for name in ("tar czf", "tar | gzip -1", f"bank level {BANK_GZIP_LEVEL}", "bank level 6"):
        ratio = med[name] / med["tar czf"]
        print(
            f"  {name:<14} {med[name]:7.3f} s  {med[name + ' bytes'] / 1048576:6.1f} MiB"
            f"  {ratio:5.2f} x tar czf"
        )
    for level in (BANK_GZIP_LEVEL, 6):
        made, put = med[f"archive level {level}"], med[f"upload level {level}"]
        print(
            f"    level {level}: archive {made:.3f} s ({made / med['tar czf']:.2f} x tar czf),"
            f" upload {put:.3f} s"
        )
    for name in ("tar xzf", "restore"):
        print(f"  {name:<14} {med[name]:7.3f} s  {med[name] / med['tar xzf']:5.2f} x tar xzf")
    bank_ratio = med[f"bank level {BANK_GZIP_LEVEL}"] / med["tar czf"]
    print(
        f"SUMMARY bank: level={BANK_GZIP_LEVEL} bank={med[f'bank level {BANK_GZIP_LEVEL}']:.3f}s"
        f" tar_czf={med['tar czf']:.3f}s ratio={bank_ratio:.2f} (target <= 0.50)"
        f" level6_ratio={med['bank level 6'] / med['tar czf']:.2f}"
        f" restore={med['restore']:.3f}s tar_xzf={med['tar xzf']:.3f}s"
        f" archive_ratio={med[f'archive level {BANK_GZIP_LEVEL}'] / med['tar czf']:.2f}"
        f" tar_gzip1_ratio={med['tar | gzip -1'] / med['tar czf']:.2f} load={load}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
