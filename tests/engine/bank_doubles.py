"""What a bare `engine.scratch.ScratchBank` speaks to in a test: an event log that records what
it said, and a fenced writer that records the scratch records it wrote."""

from __future__ import annotations

from typing import Any


class Said:
    """The event log of a bare `ScratchBank`: what it said, in order."""

    def __init__(self) -> None:
        self.said: list[tuple[str, dict[str, Any]]] = []

    def draft(self, type: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.said.append((type, data))
        return (type, data)

    async def emit(self, type: str, **data: Any) -> None:
        self.said.append((type, data))


class Records:
    """The fenced writer of a bare `ScratchBank`: the scratch records it wrote."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    async def write_record(self, fields: dict[str, Any], *, events: Any = ()) -> None:
        self.records.append(fields["scratch"])
