"""Reading the DLQ whole: `DlqStore.list` (an ephemeral consumer, `_LIST_BATCH` messages a
round trip) against the way it read before, one `get_msg` per record, measured in the same run
on the same stream.

    python -m bench.dlq_list [--records N] [--passes K] [--quick]

Every `dlq list`, `dlq replay --all`, `dlq purge --reason`, and each page of the HTTP API's
`GET /api/v1/dlq` reads the DLQ stream whole (a record's id is not its stream sequence, so a
page cannot start half-way). Records are written as a runner writes them (`DlqStore.put`,
small bodies inline). Wall time is the client's; the server runs beside it on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # `python bench/dlq_list.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import QUICK_LEASE, Bench, machine, run_main, table

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from publisher import WireNames


async def one_at_a_time(js: JetStreamContext, names: WireNames) -> int:
    """The listing before: `get_msg(seq, subject=…, next=True)` from the stream's start."""
    from nats.js.errors import NotFoundError

    count, seq = 0, 1
    while True:
        try:
            msg = await js.get_msg(
                names.dlq_stream, seq=seq, subject=names.dlq_subject("*"), next=True
            )
        except NotFoundError:
            return count
        assert msg.seq is not None
        seq = msg.seq + 1
        count += 1


async def main(args: argparse.Namespace) -> int:
    from publisher import DlqStore
    from publisher.dlq import read_record

    print(f"# bench.dlq_list: {machine()}")
    async with Bench("dlq-list", lease=QUICK_LEASE) as bench:
        rnd = await bench.new_round("dlq-list")
        assert bench.js is not None
        dlq = DlqStore(bench.js, rnd.names, None)
        n = args.records
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            await dlq.put(
                seq=i,
                body=b'{"run_id": "r", "attempt": 1}',
                headers={"Nats-Msg-Id": f"r{i}:1"},
                reason="retries_exhausted",
                run_id=f"run-{i}",
                attempt=1,
                num_delivered=2,
            )
        print(f"wrote {n} records in {time.perf_counter() - t0:.1f} s")
        rows = []
        best_old = best_new = float("inf")
        for p in range(args.passes):
            w0 = time.perf_counter()
            seen = await one_at_a_time(bench.js, rnd.names)
            old = time.perf_counter() - w0
            # The old listing parsed each record too: time that part on its own, once.
            msg = await bench.js.get_msg(
                rnd.names.dlq_stream, seq=1, subject=rnd.names.dlq_subject("*"), next=True
            )
            p0 = time.perf_counter()
            for _ in range(seen):
                read_record(msg)
            old += time.perf_counter() - p0
            w0 = time.perf_counter()
            listed = await dlq.list()
            new = time.perf_counter() - w0
            assert seen == len(listed) == n, (seen, len(listed), n)
            best_old, best_new = min(best_old, old), min(best_new, new)
            rows.append([f"pass {p + 1}", n, f"{old:.3f}", f"{new:.3f}", f"{old / new:.1f}x"])
        print(table(["pass", "records", "get_msg each s", "consumer s", "ratio"], rows))
        print(
            f"SUMMARY dlq_list: {n} records read whole in {best_new:.3f} s"
            f" ({best_old / best_new:.1f}x faster than one get_msg per record, {best_old:.3f} s;"
            f" best of {args.passes})"
        )
        await bench.end_round(rnd)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=5_000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="200 records (the CI smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.records, args.passes = 200, 1
    run_main(lambda: main(args))
