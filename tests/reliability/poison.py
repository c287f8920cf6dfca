"""The poison mix, shared by the CI fuzz (`test_poison_fuzz.py`) and its long mode
(`python -m tests.reliability.poison_fuzz`): seeded messages with the fate each must meet
(SPEC §3 DLQ records, §5.1, §5.2 steps 1-3), the victim runs they aim at, and the accounting that
finds every one of them again at the end.

Fates: `dlq` (a record with its reason), `ack` (gone from the stream, counted by the runners'
`runfleet_deliveries_total{disposition="ack"}` with its reason), `nak` (a newer schema: still in
the stream, or — once its ten 5-minute naks are spent, which only a long run reaches — a record
`unsupported_schema`).
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine.resume import ResumeRequest
from publisher import MalformedMessage, UnsupportedSchema
from publisher.dlq import INLINE_BODY_MAX
from publisher.wire import HDR_ATTEMPT, HDR_MSG_ID, RunMessage, decode, encode
from store import RunDocument, utcnow
from tests.reliability import hostile
from tests.runner.conftest import Fleet, eventually
from tests.runner.procs import released, workflow

ASK = """\
name: ask
entry: ask
nodes:
  ask:
    kind: human
    questions:
      - name: ok
        type: bool
  done:
    kind: compute
    set:
      x: "1"
edges:
  - from: ask
    to: done
"""


@dataclass(frozen=True)
class Poison:
    kind: str
    body: bytes
    headers: dict[str, str] | None
    fate: str
    """`dlq`, `ack` or `nak`."""
    reason: str


@dataclass(frozen=True)
class Victims:
    finished: RunDocument
    """Finished at attempt 1."""
    resumed: RunDocument
    """Paused, resumed, finished at attempt 2."""


WRONG_VALUES: dict[str, list[Any]] = {
    "v": ["1", "one", 0, -1, None, [1], {"v": 1}],
    "run_id": [123, "", None, ["r"], {"id": "r"}],
    "tenant": ["", 5, None, ["default"]],
    "attempt": ["one", 1.5, 0, -3, None, [1], "1e3x"],
    "kind": ["explode", 1, None, "", "LAUNCH"],
    "published_at": ["yesterday", "2026-13-45T99:99:99Z", [], {"at": 1}],
    "resume": ["yes", 5, [1, 2], {"answers": "not a dict"}, {"surprise": True}],
}


def expected_decode(body: bytes, headers: dict[str, str] | None = None) -> str | None:
    """What the product's decoder says: the oracle for hostile bodies, and a cross-check that
    the generator labels its other messages as the wire contract does."""
    try:
        decode(body, headers)
    except MalformedMessage:
        return "malformed"
    except UnsupportedSchema:
        return "unsupported_schema"
    return None


def extremes() -> list[Poison]:
    """The cases that escaped `decode` before v2.2: a 5 000-digit integer at every field
    (`ValueError`), 200 000 nested arrays and objects, as the body and at a field
    (`RecursionError`). All `malformed`."""
    m = hostile.message(str(uuid.uuid4()))
    bodies = [hostile.inject(m, path, hostile.big_int(5000)) for path in hostile.PATHS[:7]]
    bodies += [
        hostile.deep(200_000, "arrays"),
        hostile.deep(200_000, "objects"),
        hostile.inject(m, ("resume", "answers", "q"), hostile.deep(200_000, "mixed")),
    ]
    return [Poison("extreme", body, None, "dlq", "malformed") for body in bodies]


class Mix:
    """The seeded generator: each method makes one message of its kind."""

    def __init__(self, victims: Victims, rng: random.Random) -> None:
        self.victims = victims
        self.rng = rng
        self.kinds: list[Callable[[], Poison]] = [
            self.garbage,
            self.not_json,
            self.truncated,
            self.wrong_type,
            self.wrong_type,
            self.reshaped,
            self.header_mismatch,
            self.newer_schema,
            self.future_attempt,
            self.other_tenant,
            self.lost_run,
            self.superseded,
            self.settled,
            self.hostile,
        ]
        self.large_left = 0
        """How many more bodies over 256 KiB `hostile` may make (the caller rations them)."""

    def valid(self) -> dict[str, Any]:
        run = self.rng.choice([self.victims.finished, self.victims.resumed])
        return {
            "v": 1,
            "run_id": run.run_id,
            "tenant": run.tenant,
            "attempt": run.attempt,
            "kind": self.rng.choice(["launch", "resume", "replay", "handoff", "sweep"]),
            "published_at": utcnow().isoformat(),
        }

    def garbage(self) -> Poison:
        body = b"\xff" + self.rng.randbytes(self.rng.randrange(0, 512))  # never starts UTF-8
        return Poison("garbage", body, None, "dlq", "malformed")

    def not_json(self) -> Poison:
        text = self.rng.choice(["{not json", "", " ", "nul", "[1,", '{"v":1,', "\x00\x01", "}{"])
        return Poison("not_json", text.encode(), None, "dlq", "malformed")

    def truncated(self) -> Poison:
        body = json.dumps(self.valid()).encode()
        cut = self.rng.randrange(1, len(body) - 1)
        return Poison("truncated", body[:cut], None, "dlq", "malformed")

    def wrong_type(self) -> Poison:
        message = self.valid()
        key = self.rng.choice(sorted(WRONG_VALUES))
        message[key] = self.rng.choice(WRONG_VALUES[key])
        return Poison(f"wrong_{key}", json.dumps(message).encode(), None, "dlq", "malformed")

    def reshaped(self) -> Poison:
        message = self.valid()
        choice = self.rng.randrange(4)
        if choice == 0:
            message.pop(self.rng.choice(sorted(set(message) - {"v"})))  # `v` has a default
        elif choice == 1:
            message[f"x{self.rng.randrange(100)}"] = "surprise"
        elif choice == 2:
            body = json.dumps([message]).encode()
            return Poison("not_an_object", body, None, "dlq", "malformed")
        else:
            body = json.dumps(self.rng.choice([None, 7, "s", 1.5, True])).encode()
            return Poison("scalar", body, None, "dlq", "malformed")
        return Poison("reshaped", json.dumps(message).encode(), None, "dlq", "malformed")

    def huge(self) -> Poison:
        size = INLINE_BODY_MAX + self.rng.randrange(1, 200_000)
        if self.rng.random() < 0.5:
            body = b"\xff" + self.rng.randbytes(size)
        else:
            message = self.valid()
            message["padding"] = "x" * size  # an unknown field: invalid
            body = json.dumps(message).encode()
        return Poison("huge", body, None, "dlq", "malformed")

    def header_mismatch(self) -> Poison:
        message = self.valid()
        header = self.rng.choice(
            [str(message["attempt"] + self.rng.randrange(1, 5)), "abc", "-1", "01"]
        )
        body = json.dumps(message).encode()
        return Poison("header_mismatch", body, {HDR_ATTEMPT: header}, "dlq", "malformed")

    def newer_schema(self) -> Poison:
        message = self.valid()
        message["v"] = self.rng.choice([2, 3, 99, 10**6])
        if self.rng.random() < 0.5:
            message["field_from_the_future"] = {"nested": [1, 2, 3]}
        body = json.dumps(message).encode()
        return Poison("newer_schema", body, None, "nak", "unsupported_schema")

    def future_attempt(self) -> Poison:
        run = self.rng.choice([self.victims.finished, self.victims.resumed])
        message = RunMessage(
            run_id=run.run_id,
            tenant=run.tenant,
            attempt=run.attempt + self.rng.randrange(1, 1000),
            kind=self.rng.choice(["resume", "handoff", "sweep"]),
            published_at=utcnow(),
        )
        body, headers = encode(message)
        headers[HDR_MSG_ID] = uuid.uuid4().hex  # never deduplicated away
        return Poison("future_attempt", body, headers, "dlq", "attempt_ahead")

    def other_tenant(self) -> Poison:
        message = self.valid()
        message["tenant"] = self.rng.choice(["intruder", "Default", "default ", "t" * 200])
        body = json.dumps(message).encode()
        return Poison("other_tenant", body, None, "dlq", "tenant_mismatch")

    def lost_run(self) -> Poison:
        old = self.rng.random() < 0.5
        message = RunMessage(
            run_id=str(uuid.uuid4()),
            tenant="default",
            attempt=self.rng.randrange(1, 5),
            kind="launch",
            published_at=utcnow()
            - (timedelta(minutes=self.rng.randrange(1, 600)) if old else timedelta(0)),
        )
        body, headers = encode(message)
        return Poison("lost_old" if old else "lost_young", body, headers, "dlq", "run_not_found")

    def superseded(self) -> Poison:
        message = self.valid()
        message.update(run_id=self.victims.resumed.run_id, attempt=self.victims.resumed.attempt - 1)
        return Poison("superseded", json.dumps(message).encode(), None, "ack", "superseded")

    def settled(self) -> Poison:
        return Poison("settled", json.dumps(self.valid()).encode(), None, "ack", "settled")

    def hostile(self) -> Poison:
        """A lost run's message (old, so its first delivery judges it) with one hostile value
        (`tests/reliability/hostile.py`), labelled by the decoder itself: malformed, a newer
        schema, or — still a valid message — `run_not_found`."""
        doc = hostile.message(
            str(uuid.uuid4()), published_at=(utcnow() - timedelta(hours=1)).isoformat()
        )
        kind, body = hostile.random_hostile(self.rng, doc, large=self.large_left > 0)
        if len(body) > INLINE_BODY_MAX:
            self.large_left -= 1
        said = expected_decode(body)
        if said == "malformed":
            return Poison(kind, body, None, "dlq", "malformed")
        if said == "unsupported_schema":
            return Poison(kind, body, None, "nak", "unsupported_schema")
        return Poison(kind, body, None, "dlq", "run_not_found")


def generate(victims: Victims, rng: random.Random, count: int, *, huge: int = 4) -> list[Poison]:
    """`count` messages, every kind twice then a seeded mix; `huge` bodies over 256 KiB and the
    `extremes()` on top, all shuffled."""
    mix = Mix(victims, rng)
    out = [
        mix.kinds[i % len(mix.kinds)]() if i < 2 * len(mix.kinds) else rng.choice(mix.kinds)()
        for i in range(count)
    ]
    out += [mix.huge() for _ in range(huge)]
    out += extremes()
    rng.shuffle(out)
    return out


def stream(victims: Victims, rng: random.Random, count: int, *, large: int) -> Iterator[Poison]:
    """The long mode's `count` messages, made one at a time (only their labels are kept): every
    kind first, the extremes once, then a seeded mix with at most `large` more bodies over
    256 KiB."""
    mix = Mix(victims, rng)
    mix.large_left = large
    first = [make() for make in mix.kinds] + extremes()
    yield from first[:count]
    for _ in range(count - len(first)):
        yield rng.choice(mix.kinds)()


def metric_samples(text: str, family_name: str) -> Counter[tuple[str, ...]]:
    """One counter family of a `/metrics` page, by its sorted label values."""
    out: Counter[tuple[str, ...]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                out[tuple(sorted(s.labels.values()))] += int(s.value)
    return out


def metric_counts(text: str, family_name: str, *labels: str) -> Counter[tuple[str, ...]]:
    """One counter family of a `/metrics` page, by the values of `labels` in that order."""
    out: Counter[tuple[str, ...]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[tuple(s.labels[k] for k in labels)] += int(s.value)
    return out


def ack_key(reason: str) -> tuple[str, ...]:
    return tuple(sorted(("ack", reason)))


async def make_victims(fleet: Fleet, book: Path) -> Victims:
    """Two real runs the mix aims at (a runner must be serving): one finished at attempt 1,
    one paused, resumed and finished at attempt 2."""
    finished = await fleet.launch(workflow("one_step"), {"ledger": str(book), "tag": "victim"})
    asked = await fleet.launch(ASK)
    await fleet.wait_status(asked.run_id, "paused_waiting_human")
    await eventually(released(fleet, asked.run_id))
    await fleet.publisher.resume(
        asked.run_id, ResumeRequest(cli_answers={"ok": "yes"}), tenant="default"
    )
    done = [
        await fleet.wait_status(finished.run_id, "finished"),
        await fleet.wait_status(asked.run_id, "finished"),
    ]
    for doc in done:
        await eventually(released(fleet, doc.run_id))
    assert await fleet.queue_drained()
    return Victims(
        finished=await fleet.store.get_run(finished.run_id),
        resumed=await fleet.store.get_run(asked.run_id),
    )
