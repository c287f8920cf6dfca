"""Where every fuzzed message ended (SPEC §13.4: none vanishes), for the CI fuzz and its long
mode alike: a DLQ record with its reason (its bytes kept), gone from the work stream (acked), or
still in it (nak'd and waiting). Reading is by sequence: the DLQ through an ephemeral consumer
(one pass, not one request per record), the work stream by `get_msg` (a work-queue stream takes
no second consumer).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from dataclasses import dataclass, field

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from publisher.dlq import DlqRecord
from tests.reliability.poison import Poison
from tests.runner.conftest import Fleet


@dataclass(frozen=True, slots=True)
class Label:
    """What the fuzz keeps of a sent message: its kind, its expected fate, its bytes' digest."""

    kind: str
    fate: str
    reason: str
    digest: str

    @property
    def expected(self) -> str:
        return f"{self.fate}:{self.reason}"

    def accepts(self, observed: str) -> bool:
        if self.fate == "dlq":
            return observed == f"dlq:{self.reason}"
        if self.fate == "ack":
            return observed == "acked"
        # A newer schema waits in the stream; after its ten 5-minute naks, the DLQ has it.
        return observed in ("in_stream", f"dlq:{self.reason}")


def digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def label(p: Poison) -> Label:
    return Label(p.kind, p.fate, p.reason, digest(p.body))


@dataclass
class Account:
    observed: dict[int, str]
    """seq → `dlq:<reason>`, `acked` or `in_stream`."""
    records: dict[int, DlqRecord]
    violations: list[str] = field(default_factory=list)
    by_expected: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)

    def count(self, observed: str) -> int:
        return sum(1 for o in self.observed.values() if o == observed)


async def read_dlq(fleet: Fleet, *, batch: int = 256) -> dict[int, DlqRecord]:
    """Every DLQ record, by id, in one pass of an ephemeral consumer."""
    info = await fleet.js.stream_info(fleet.names.dlq_stream)
    left = int(info.state.messages)
    out: dict[int, DlqRecord] = {}
    if left == 0:
        return out
    psub = await fleet.js.pull_subscribe(
        fleet.names.dlq_subject("*"),
        stream=fleet.names.dlq_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
    )
    try:
        while True:
            try:
                msgs = await psub.fetch(batch=batch, timeout=5.0)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            for msg in msgs:
                record = DlqRecord.model_validate_json(msg.data or b"{}")
                out[record.id] = record
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await psub.unsubscribe()
    return out


async def in_stream(fleet: Fleet, seqs: list[int], *, width: int = 128) -> set[int]:
    """Which of `seqs` are still in the work stream."""

    async def present(seq: int) -> int | None:
        try:
            await fleet.js.get_msg(fleet.names.runs_stream, seq)
        except NotFoundError:
            return None
        return seq

    found: set[int] = set()
    for i in range(0, len(seqs), width):
        got = await asyncio.gather(*(present(s) for s in seqs[i : i + width]))
        found.update(s for s in got if s is not None)
    return found


async def account(fleet: Fleet, sent: dict[int, Label]) -> Account:
    """Find every sent message again; a violation for each one whose end is not the one its
    label allows, each DLQ body that changed, and each DLQ record nobody sent."""
    records = await read_dlq(fleet)
    rest = sorted(set(sent) - set(records))
    waiting = await in_stream(fleet, rest)
    observed = {seq: f"dlq:{records[seq].reason}" for seq in sent if seq in records}
    observed |= {seq: ("in_stream" if seq in waiting else "acked") for seq in rest}
    acc = Account(observed, records)
    for seq, lab in sent.items():
        got = observed[seq]
        acc.by_expected[lab.expected, got] += 1
        acc.by_kind[lab.kind, got] += 1
        if not lab.accepts(got):
            acc.violations.append(f"seq {seq} ({lab.kind}): expected {lab.expected}, got {got}")
    for seq in sorted(set(records) - set(sent)):
        acc.violations.append(f"DLQ record {seq} ({records[seq].reason}) for no fuzzed message")
    for seq in sorted(set(records) & set(sent)):
        body = await fleet.dlq.body(records[seq])
        if digest(body) != sent[seq].digest:
            acc.violations.append(f"seq {seq} ({sent[seq].kind}): DLQ body changed")
    return acc


def pivot(rows: Counter[tuple[str, str]], title: str, *, total: str = "sent") -> str:
    """A text table: one row per first key, one column per second key, a total column."""
    names = sorted({r for r, _ in rows})
    cols = sorted({c for _, c in rows})
    header = [title, total, *cols]
    body = [
        [name, str(sum(rows[name, c] for c in cols)), *(str(rows[name, c] or "") for c in cols)]
        for name in names
    ]
    sums = ["total", str(sum(rows.values())), *(str(sum(rows[n, c] for n in names)) for c in cols)]
    widths = [max(len(r[i]) for r in [header, *body, sums]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in body), rule, line(sums)])
