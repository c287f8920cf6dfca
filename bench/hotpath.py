"""The pieces of a delivery's CPU that issue 19's seventh pass changed, each timed against the
form it replaced, in one process, back to back.

`bench.throughput` cannot resolve a change of 1-3 % of a run's CPU on these machines (its
alternating pairs move ±10 % by themselves). This times each piece alone, on a run document
shaped like the benchmark's (a one-node run, finished, with its checkpoint, publication and
workflow source), and prints the ratio new / old. The "old" forms are kept here, verbatim, as
the baseline.

    python -m bench.hotpath [--quick]
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from runner.delivery_log import DeliveryEntry, encode_entry
from store.cas import Eq, LeaseFree, Update, _check_update, check_update
from store.codec import decode, encode
from store.models import (
    Checkpoint,
    Lease,
    Origin,
    Publication,
    RunDocument,
    RunStatus,
    WorkflowRef,
)
from store.sqlite.runs import _run
from store.sqlite.schema import dumps
from store.timeutil import truncate_ms, utcnow

_OLD_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

SOURCE = 'name: bench_one\nentry: a\nnodes:\n  a:\n    kind: compute\n    set:\n      x: "1 + 1"\n'


def a_run() -> RunDocument:
    now = utcnow()
    return RunDocument(
        run_id="01a2374f-28cc-7fb0-9828-d84b86182b90",
        tenant="default",
        origin=Origin.FLEET,
        workflow=WorkflowRef(name="bench_one", source=SOURCE, source_hash="0" * 64),
        inputs={},
        status=RunStatus.RUNNING,
        attempt=1,
        attempt_at=now,
        publication=Publication(attempt=1, stream_seq=1, at=now, msg_id="x:1"),
        lease=Lease(owner="runner-a", token="t" * 32, attempt=1, stream_seq=1, expires_at=now),
        checkpoint=Checkpoint(outputs={"a": {"x": 2}}, progress=1, completed=["a"]),
        created_at=now,
        updated_at=now,
    )


def old_utcnow() -> datetime:
    return truncate_ms(datetime.now(UTC))


def pairs() -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    doc = a_run()
    stored = encode(doc)
    text = _OLD_ENCODER.encode(stored)
    conditions = [
        Eq("status", RunStatus.QUEUED),
        Eq("attempt", 1),
        Eq("version", 3),
        LeaseFree(utcnow(), timedelta(seconds=1)),
    ]
    claim = Update(
        set={"status": RunStatus.RUNNING, "lease": {}, "publication": {}, "failure_code": None}
    )
    entry = {
        "v": 1,
        "run_id": doc.run_id,
        "stream_seq": 5,
        "num_delivered": 1,
        "attempt": 1,
        "action": "ack",
        "reason": "finished",
        "delay": None,
        "record_id": None,
        "runner": "runner-a",
    }
    return [
        (
            "store text: json → orjson, read back and compared",
            lambda: _OLD_ENCODER.encode(stored),
            lambda: dumps(stored),
        ),
        (
            "run read: json.loads + validate → pydantic's JSON reader",
            lambda: decode(RunDocument, json.loads(text), what="run", ident=doc.run_id),
            lambda: _run(text, doc.run_id),
        ),
        (
            "delivery log entry: model → encode_entry",
            lambda: DeliveryEntry.model_construct(**entry, at=utcnow()).model_dump_json().encode(),
            lambda: encode_entry({**entry, "at": utcnow()}),
        ),
        (
            "check_update: every write → shapes remembered",
            lambda: _check_update(conditions, claim),
            lambda: check_update(conditions, claim),
        ),
        ("utcnow: truncated datetime.now → epoch ms", old_utcnow, utcnow),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    ap.add_argument("--number", type=int, default=20_000, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per form (the best is kept)")
    args = ap.parse_args()
    number, repeat = (200, 2) if args.quick else (args.number, args.repeat)
    print(f"hotpath: best of {repeat} x {number} calls per form, µs per call")
    print("| piece | old µs | new µs | new / old |")
    print("|---|---|---|---|")
    saved = 0.0
    ratios = []
    for name, old, new in pairs():
        assert_same(name, old(), new())
        # Alternate the two forms so a change of the machine's speed hits both alike.
        t_old, t_new = [], []
        for _ in range(repeat):
            t_old.append(timeit.timeit(old, number=number) / number * 1e6)
            t_new.append(timeit.timeit(new, number=number) / number * 1e6)
        o, n = min(t_old), min(t_new)
        saved += o - n
        ratios.append(n / o)
        print(f"| {name} | {o:.2f} | {n:.2f} | {n / o:.2f} |")
    print(
        f"SUMMARY hotpath: {len(ratios)} pieces, new/old {min(ratios):.2f}-{max(ratios):.2f},"
        f" {saved:.1f} µs saved per call of each"
    )


def assert_same(name: str, old: Any, new: Any) -> None:
    """The two forms answer alike: the same model, or the same JSON once parsed (a log
    entry's `at` aside: each form asked for now on its own). Two instants are not compared."""
    if isinstance(old, datetime):
        return
    if isinstance(old, str | bytes):
        old, new = json.loads(old), json.loads(new)
        for parsed in (old, new):
            if isinstance(parsed, dict):
                parsed.pop("at", None)
    if old != new:
        raise SystemExit(f"{name}: the new form answers differently: {old!r} != {new!r}")


if __name__ == "__main__":
    main()
