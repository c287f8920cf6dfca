"""The narrow writes on SQLite, the lease refresh and the publication record: each as one
`UPDATE … json_set … RETURNING` against the general compare-and-set it replaced (read the row,
parse it, judge, apply, validate the whole new document, encode it, write it), in one process,
on one store, the two forms alternated.

`bench.lease` measures a whole beat (the refresh, the working ack, the metrics, the timers) in a
runner holding 1 000 runs; its rounds move by ±1-2 points of a core by themselves, more than the
store's part of a beat. This times the store's part alone: process CPU (the store thread's too)
and wall time per refresh, over runs shaped like a held run of the benchmark (its workflow
source, its inputs, a checkpoint of a few nodes). The publication record is the write a launch
makes after each publish (`Publisher.record_publication`). The "old" form is the general path
itself, taken by hiding the write's shape from the store (`store.sqlite.runs.narrow_write`).

    python -m bench.refresh [--quick] [--runs N] [--rounds K]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # `python bench/refresh.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import store.sqlite.runs as sqlite_runs
from bench.hotpath import a_run
from store.cas import Condition, Eq, Ne, Update
from store.models import Checkpoint, Lease, RunDocument
from store.sqlite import SqliteRunStore
from store.timeutil import utcnow

TOKEN = "t" * 32


@contextmanager
def general_path() -> Iterator[None]:
    """Every write takes the general compare-and-set, as before the narrow writes."""
    real = sqlite_runs.narrow_write
    sqlite_runs.narrow_write = lambda conditions, update: None
    try:
        yield
    finally:
        sqlite_runs.narrow_write = real


def held_run(i: int) -> RunDocument:
    base = a_run()
    return base.model_copy(
        update={
            "run_id": f"{base.run_id[:-6]}{i:06d}",
            "inputs": {"name": "Ada", "n": i, "tags": ["a", "b", "c"]},
            "lease": Lease(
                owner="runner-a",
                token=TOKEN,
                attempt=1,
                stream_seq=i + 1,
                expires_at=utcnow() + timedelta(seconds=30),
            ),
            "checkpoint": Checkpoint(
                outputs={f"n{k}": {"x": k, "text": "ok" * 8} for k in range(4)},
                progress=4,
                completed=[f"n{k}" for k in range(4)],
                restart_node="n4",
            ),
        }
    )


Write = Callable[[str, int], tuple[list[Condition], Update]]


def refresh(run_id: str, pass_no: int) -> tuple[list[Condition], Update]:
    """What `LeaseKeeper.refresh_once` writes."""
    until = utcnow() + timedelta(seconds=30)
    return [Eq("lease.token", TOKEN)], Update(set={"lease.expires_at": until}, bump_version=False)


def record_publication(run_id: str, pass_no: int) -> tuple[list[Condition], Update]:
    """What `Publisher.record_publication` writes; a new stream sequence each pass, so that
    each write lands."""
    seq = 1_000 + pass_no
    publication = {"attempt": 1, "stream_seq": seq, "at": utcnow(), "msg_id": f"{run_id}:1"}
    return [Eq("attempt", 1), Ne("publication.stream_seq", seq)], Update(
        set={"publication": publication}, bump_version=False
    )


async def one_pass(
    store: SqliteRunStore, ids: list[str], write: Write, pass_no: int
) -> tuple[float, float]:
    """CPU µs and wall µs per write over `ids`, each written once."""
    cpu, wall = time.process_time(), time.perf_counter()
    for run_id in ids:
        done = await store.update_run(run_id, *write(run_id, pass_no))
        assert isinstance(done, RunDocument), done
    n = len(ids)
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


async def compare(
    store: SqliteRunStore, ids: list[str], name: str, write: Write, rounds: int
) -> str:
    """Prints the two forms' rows; returns the summary's part for `name`."""
    passes = iter(range(1_000_000))
    await one_pass(store, ids, write, next(passes))  # warm the page cache and the shapes
    old_cpu: list[float] = []
    new_cpu: list[float] = []
    old_wall: list[float] = []
    new_wall: list[float] = []
    for _ in range(rounds):  # alternated: a change of the machine's speed hits both
        with general_path():
            c, w = await one_pass(store, ids, write, next(passes))
        old_cpu.append(c)
        old_wall.append(w)
        c, w = await one_pass(store, ids, write, next(passes))
        new_cpu.append(c)
        new_wall.append(w)
    oc, nc = statistics.median(old_cpu), statistics.median(new_cpu)
    ow, nw = statistics.median(old_wall), statistics.median(new_wall)
    print(f"| {name} | general compare-and-set (old) | {oc:.1f} | {ow:.1f} |")
    print(f"| {name} | narrow write (new) | {nc:.1f} | {nw:.1f} |")
    return f"{name} CPU new/old {nc / oc:.2f} ({oc:.0f} -> {nc:.0f} µs), wall {nw / ow:.2f}"


async def main_async(runs: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="runfleet-bench-refresh-") as tmp:
        store = await SqliteRunStore.open(Path(tmp) / "runs.db")
        try:
            ids = []
            for i in range(runs):
                ids.append((await store.create_run(held_run(i))).run_id)
            size = len(held_run(0).model_dump_json())
            print(f"refresh: {runs} held runs (≈ {size} bytes each), {rounds} rounds per form")
            print("| write | form | CPU µs per write (median) | wall µs per write (median) |")
            print("|---|---|---|---|")
            parts = [
                await compare(store, ids, "refresh", refresh, rounds),
                await compare(store, ids, "publication", record_publication, rounds),
            ]
            print("SUMMARY refresh: " + "; ".join(parts))
        finally:
            await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    ap.add_argument("--runs", type=int, default=1_000, help="held runs, each refreshed per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per form")
    args = ap.parse_args()
    runs, rounds = (50, 2) if args.quick else (args.runs, args.rounds)
    asyncio.run(main_async(runs, rounds))


if __name__ == "__main__":
    main()
