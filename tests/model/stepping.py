"""Driving the machine by hand, one actor's operations at a time: for the replays of
`test_protocol_replays.py` and the scenarios of `test_protocol_scenarios.py`."""

from __future__ import annotations

from tests.model.actors import Actor
from tests.model.machine import ProtocolModel


def _actor(model: ProtocolModel, prefix: str) -> Actor:
    return next(a for a in model.actors if a.name.startswith(prefix))


def _until(model: ProtocolModel, actor: Actor, label: str) -> None:
    """Grant `actor` operations until it is parked at an operation starting with `label`."""
    for _ in range(100):
        if actor.parked and actor.label.startswith(label):
            return
        assert actor.parked, f"{actor.name} ended before {label!r}"
        model._grant(actor)
    raise AssertionError(f"{actor.name} never reached {label!r}")


def _finish(model: ProtocolModel, actor: Actor) -> None:
    while actor.parked:
        model._grant(actor)
    model._reap()
