"""The model's bookkeeping: the machine running now (`_MODEL`, one per example), what happened
over all examples (`COVERAGE`, `STEPS_TAKEN`), the known findings (`KNOWN`), the notes that tell
a failing example's story, and the log handler that makes the product's error logs findings.

`_MODEL` is rebound by every machine (`ProtocolModel.__init__` and `_close`): read it as
`bookkeeping._MODEL` (or through `_current()`), never as a copy imported by name."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from hypothesis import event, note
from hypothesis.control import currently_in_test_context

from tests.model.actors import ACTOR

if TYPE_CHECKING:
    from tests.model.machine import ProtocolModel

_MODEL: ProtocolModel | None = None
COVERAGE: Counter[str] = Counter()
"""In how many examples each thing happened (the test prints it; `-s` shows it)."""
STEPS_TAKEN = [0]
"""Rule steps run, over all examples (hypothesis draws each example's length)."""
KNOWN: dict[str, str] = {}
"""Violations of the product the model found and that are still open, by kind, with the test
that replays each (a strict xfail, in `test_protocol_replays.py`). The machine counts them
instead of failing, so it keeps exploring everything else; a replay reports them."""


def _current() -> ProtocolModel:
    assert _MODEL is not None, "no model is running"
    return _MODEL


def _seen(what: str) -> None:
    if currently_in_test_context():
        event(what)
    if _MODEL is not None:
        _MODEL.seen.add(what)


def _note(text: str) -> None:
    """A line of the failing example's story: what each actor did, step by step."""
    if currently_in_test_context():
        note(text)


class _Errors(logging.Handler):
    """Error logs from the product are findings (a lease taken over is expected news)."""

    def __init__(self, model: ProtocolModel) -> None:
        super().__init__(logging.ERROR)
        self.model = model

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] not in ("runner", "engine", "publisher", "store"):
            return
        if record.name == "engine.lease" and "taken over" in record.getMessage():
            return
        text = record.getMessage()
        if record.name == "runner.delivery" and "unexpected error" in text:
            # The last resort: under the held lease every error is an outcome, and a store
            # error at admission is a nak (SPEC v2.2 §5.1). Reaching it is a finding.
            self.model.violation("escaped_to_last_resort", f"{text}: {record.exc_info!r}")
            return
        if record.exc_info is not None and self.model.is_injected(record.exc_info[1]):
            return  # the error the machine raised on purpose, logged where it was caught
        actor = ACTOR.get()
        if actor is not None and actor.hostile and record.exc_info is None:
            return  # a hostile advisory, said once at error level and acked
        self.model.violation("error_log", f"{record.name}: {text}")
