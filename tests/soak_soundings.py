"""What the soak counts about the broker after the fact (the cluster soak's table, issue 21).

- Publications answered `duplicate` by the runs stream's dedupe window: a retry or a sweeper
  republish whose copy had landed (the publisher logs each, `publisher/publisher.py`). Counted in
  every runner's log and, through a logging handler, in the soak's own publisher (launches,
  resumes, replays); the CLI resumes the soak runs are not counted.
- Redeliveries: deliveries beyond a message's first, from the delivery log (SPEC v2.2 §10b),
  one per distinct (stream sequence, delivery count) above 1. The log is fire-and-forget, so a
  line published while the broker was away is missing: a lower bound.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable

import nats.errors
from nats.js import JetStreamContext

from publisher.wire import WireNames

DEDUPE_LINE = re.compile(r"publication of attempt \d+ answered duplicate")
_READ_TIMEOUT_S = 5.0


class DedupeCounter(logging.Handler):
    """Counts the dedupe answers the soak's own publisher logs (install with `install`)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if DEDUPE_LINE.search(record.getMessage()):
            self.count += 1

    def install(self) -> None:
        logger = logging.getLogger("publisher.publisher")
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

    def remove(self) -> None:
        logging.getLogger("publisher.publisher").removeHandler(self)


def count_dedupe_answers(logs: Iterable[str]) -> int:
    return sum(len(DEDUPE_LINE.findall(text)) for text in logs)


async def count_redeliveries(js: JetStreamContext, names: WireNames) -> int:
    """Read the whole delivery log once (an ordered consumer) and count the redeliveries."""
    seen: set[tuple[int, int]] = set()
    sub = await js.subscribe(names.delivery_subject("*"), ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=_READ_TIMEOUT_S)
            except nats.errors.TimeoutError:
                break  # an empty log, or the end of it
            try:
                entry = json.loads(msg.data)
                if int(entry["num_delivered"]) > 1:
                    seen.add((int(entry["stream_seq"]), int(entry["num_delivered"])))
            except (ValueError, KeyError, TypeError):
                pass  # not a delivery entry: nothing to count
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return len(seen)
