"""What `Execution.run()` returns (SPEC §5.4 "the engine's API"): a typed outcome, checkpoint
already written, sandbox still up. The caller writes the status (step 1) and disposes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

PauseKind = Literal["human", "operator", "budget"]


class CancelReason(StrEnum):
    OPERATOR = "operator"
    DRAIN = "drain"
    LEASE_LOST = "lease_lost"


@dataclass(frozen=True, slots=True)
class Finished:
    pass


@dataclass(frozen=True, slots=True)
class Paused:
    kind: PauseKind
    node: str | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """A node failed with `code` (after its in-process retries), or a `fail` node was reached
    (`deliberate`, with the bot's `resumable`)."""

    code: str
    error: str
    node: str | None = None
    deliberate: bool = False
    resumable: bool | None = None
    warning: str | None = None


@dataclass(frozen=True, slots=True)
class Cancelled:
    """An operator cancel. Drain and lease loss never produce this (they are `Interrupted`)."""


@dataclass(frozen=True, slots=True)
class Interrupted:
    reason: CancelReason


Outcome = Finished | Paused | Failed | Cancelled | Interrupted
