"""The soak's hostile bodies (SPEC v2.2 §5.2 step 1, §13.12): poison built to make a decoder
raise something other than its typed errors. Before v2.2 a 5 000-digit integer escaped `decode`
as `ValueError` (Python's 4 300-digit int-string limit) and 200 000 nested arrays as
`RecursionError`; each took the transient ladder instead of the DLQ. Every body here must end as
one DLQ record with reason `malformed`, whatever it names — several name a real run, which must
be left untouched.

Kept apart from `tests/reliability/hostile.py` (the fuzz's vocabulary) on purpose: the soak needs
a fixed handful, sized for a NATS message (the server's default `max_payload` is 1 MiB, so a
body of several MiB cannot reach the work subject at all; the largest string here is just
under it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from publisher.wire import HDR_ATTEMPT

STRING_BODY_BYTES = 1_000_000
"""The huge-string body's size: under the 1 MiB `max_payload`, with room for its headers."""
_HOLE = "\x00hole\x00"


@dataclass(frozen=True, slots=True)
class HostileBody:
    name: str
    body: bytes
    headers: dict[str, str] | None = None


def _message(run_id: str, published_at: datetime, **fields: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "run_id": run_id,
        "tenant": "default",
        "attempt": 1,
        "kind": "launch",
        "published_at": published_at.isoformat(),
        **fields,
    }


def _with_raw(doc: dict[str, Any], key: str, raw: str) -> bytes:
    """`doc` as JSON with the value at `key` replaced by the raw JSON text `raw` (`json.dumps`
    cannot write a 5 000-digit integer: it refuses past the int-string limit too)."""
    return json.dumps({**doc, key: _HOLE}).replace(json.dumps(_HOLE), raw, 1).encode()


def hostile_bodies(victim: str, published_at: datetime) -> list[HostileBody]:
    """Each `malformed`. `victim` is a real run: a body naming it must not touch it."""
    big = "1" + "0" * 4999
    m = _message(victim, published_at)
    filler = STRING_BODY_BYTES - len(json.dumps(m))
    wrong_types: dict[str, Any] = {
        "run_id": ["not", "a", "string"],
        "tenant": 7,
        "attempt": "second",
        "kind": {"launch": True},
        "published_at": True,
        "resume": "yes please",
    }
    out = [
        HostileBody("int_5000_at_attempt", _with_raw(m, "attempt", big)),
        HostileBody("int_5000_top_level", big.encode()),
        HostileBody("deep_200k_arrays", b"[" * 200_000 + b"0" + b"]" * 200_000),
        HostileBody("string_1mb_at_kind", _with_raw(m, "kind", json.dumps("x" * filler))),
        *(
            HostileBody(f"wrong_type_at_{key}", json.dumps({**m, key: value}).encode())
            for key, value in wrong_types.items()
        ),
        # A valid body whose attempt header lies (and is 5 000 digits long).
        HostileBody("lying_attempt_header", json.dumps(m).encode(), {HDR_ATTEMPT: "9" * 5000}),
    ]
    assert all(len(h.body) <= STRING_BODY_BYTES for h in out), [len(h.body) for h in out]
    return out
