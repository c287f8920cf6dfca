"""Nak delays (SPEC §5.5). Every nak passes its delay: a plain `nak()` ignores the consumer's
BackOff list and redelivers at once, burning the delivery budget in milliseconds (NOTES.md)."""

from __future__ import annotations

from datetime import timedelta

from engine.failures import nak_delay


def busy_delay(num_delivered: int, max_deliver: int, interval: timedelta, last: timedelta) -> float:
    """The busy ladder: doubling towards `last` (= unwind ceiling + TTL) at the final nak, never
    below one lease interval, so the last retry outlives the longest hold an unwinding
    execution can have. Stateless: it depends only on how many deliveries are left."""
    naks_left = max(max_deliver - num_delivered, 1)
    delay: float = last.total_seconds() / 2.0 ** (naks_left - 1)
    return max(interval.total_seconds(), delay)


def transient_delay(code: str, num_delivered: int, base: timedelta, cap: timedelta) -> float:
    return nak_delay(code, num_delivered, base.total_seconds(), cap.total_seconds())
