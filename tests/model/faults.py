"""The faults the protocol model injects (issue 12 item 8; SPEC v2.2 §5.1, §5.6, §5.8, §13.12).

Two families, both drawn by hypothesis in `machine.py` (`test_protocol_model.py` runs it):

- **errors under the runner's own feet**: one-shot faults armed at a named point (`POINTS`).
  Before the claim a store error (SPEC v2.2 §5.1: nak, never a DLQ record); under the held lease
  an error at every step from the claim's winning CAS to the disposition — the sandbox driver's
  `stop_others`, the `run_claimed` append, a stored workflow that no longer loads, a node
  boundary's checkpoint write, the sandbox's stop in teardown — which must become one
  `INTERNAL_ERROR` outcome, its `node_finished` never landing without its checkpoint (§13.6);
  the sandbox's start and the bank's read when a banked scratch is restored (SPEC §7.4), which
  must become the restore's own typed failure and hold the bank; and the store going away
  between the engine and the disposition (the status write, the park, the release, the
  drain's handoff CAS, the status events, the cancel read before a park), which must nak with
  no record standing. A store fault may lose its reply: the write lands and the caller
  still sees the error, as a client does when the connection drops after the server
  committed. And one fault outside the runner: the backstop's park meeting an unexpected
  error (its catch-all records `internal_error`);
- **hostile bodies** on the work subject and on the advisory subject: garbage bytes, 5 000-digit
  integers, 200 000-deep nesting, wrong types at every field, a lying `Runfleet-Attempt`
  header. A body must end as a DLQ `malformed` record (not replayable); an advisory that names
  no sequence is acked; neither may stop a runner or the backstop (§13.12).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from engine.failures import FailureCode
from publisher.errors import MalformedMessage
from publisher.wire import HDR_ATTEMPT, decode
from store import StoreUnavailable, Update


class ModelFault(RuntimeError):
    """An error the model raised on purpose (a sandbox driver, a sandbox stop)."""


def outage(what: str) -> StoreUnavailable:
    """The store cannot be reached, on purpose: the very error the backends raise (the machine
    keeps each one it raises, to tell its error logs from the product's own)."""
    return StoreUnavailable(f"model: the store is unreachable ({what})")


ADMISSION = "admission"
"""Any store operation of a delivery before its claim won: the read, the claim's CAS,
`cancel_stale`, `park_refusal`, the hand-on's CAS, their events."""

BACKSTOP = "backstop"
"""The backstop's park CAS raising something unexpected (not a store error): its catch-all
records the message `internal_error` and deletes it, leaving the run as it was — the case the
sweeper must park rather than republish (§5.9, issue 12 item 6)."""

POINTS = (
    ADMISSION,
    "stop_others",  # the driver, in `Execution.begin`
    "run_claimed",  # the claim's first event, in `Execution.begin`
    "load",  # the run's stored workflow, parsed lazily under the held lease
    "checkpoint",  # a node boundary's checkpoint write, before the engine returned
    "sandbox_start",  # the driver's start, when a banked scratch is restored (§7.4)
    "bank_read",  # the banked archive's read from the blob store, at the restore (§7.4)
    "teardown",  # the sandbox's stop
    "status",  # the outcome's status write (and its cancel variant)
    "park_read",  # the last delivery's read for a pending cancel, before its DLQ record
    "park",  # the last delivery's DLQ_PARKED write, after its DLQ record
    "release",  # the lease's release
    "handoff",  # the drain's handoff CAS
    "event",  # a status event after the engine returned
    BACKSTOP,
)
POST_ENGINE_STORE = frozenset({"status", "park_read", "park", "release", "handoff", "event"})
"""The store points between the engine and the disposition."""
LOST_REPLY = frozenset(
    {ADMISSION, "checkpoint", "status", "park", "release", "handoff", "event", BACKSTOP}
)
"""Store points where a fault may land the write and still raise."""


def write_point(update: Update) -> str | None:
    """The post-engine point a leased execution's `update_run` is at, or None (a checkpoint, a
    scratch record, a keeper's refresh: the engine's own writes are not this fault's)."""
    fields = update.set
    if fields.get("failure_code") == FailureCode.DLQ_PARKED:
        return "park"
    if "status" in fields:
        return "status"
    if "lease" in update.unset:
        return "handoff" if "attempt" in fields else "release"
    return None


# -- hostile bodies ------------------------------------------------------------------------------

HUGE_DIGITS = 5_000
"""Past Python's int-string limit (4 300 digits): `json.loads` raises `ValueError`."""
DEEP = 200_000
"""Past any recursion limit: `json.loads` raises `RecursionError`."""

WRONG_TYPES: dict[str, tuple[bytes, ...]] = {
    "v": (b'"1"', b"[1]", b"0", b'"x"'),
    "run_id": (b"5", b"[]", b"null", b'""', b"{}"),
    "tenant": (b"7", b"{}", b'""', b"null"),
    "attempt": (b"[1]", b'{"n": 1}', b"1.5", b'"one"', b"0", b"-3", b"null"),
    "kind": (b"3", b'"nope"', b"null", b"[]"),
    "published_at": (b"[]", b'"yesterday"', b"{}", b"null"),
    "resume": (b'"x"', b"[1]", b'{"consents": {"force": "maybe"}}', b'{"answers": 3}'),
    "surprise": (b"1", b'"extra fields are refused"'),
}
"""Values the validator must refuse at each field of `RunMessage` (and an unknown field). Not
`true` for `v` or `attempt`: pydantic's lax mode reads it as 1."""

NOT_OBJECTS = (b"[]", b"1", b'"x"', b"null", b"true", b"[{}]", b"1e999")
BAD_ADVISORIES = (
    b"",
    b"\xff\xfe",
    b"[]",
    b'{"stream_seq": "1"}',
    b'{"stream_seq": 1.0}',
    b'{"stream_seq": -1}',
    b'{"stream_seq": true}',
    b'{"stream_seq": 18446744073709551616}',
    b'{"stream_seq": ' + b"9" * HUGE_DIGITS + b"}",
    b"[" * DEEP + b"]" * DEEP,
)
"""MAX_DELIVERIES advisories that name no sequence the backstop may act on."""

_HOLE = "\x00hole\x00"


@dataclass(frozen=True, slots=True)
class Hostile:
    kind: str
    body: bytes
    headers: dict[str, str]


def message(run_id: str, attempt: int) -> dict[str, Any]:
    """A valid body for the model's run (so a hostile value sits among real fields)."""
    return {
        "v": 1,
        "run_id": run_id,
        "tenant": "default",
        "attempt": attempt,
        "kind": "resume",
        "published_at": "2030-01-01T00:00:00+00:00",
    }


def inject(doc: dict[str, Any], field: str, raw: bytes) -> bytes:
    """`doc` as JSON with `field`'s value replaced by the raw JSON text `raw` (which
    `json.dumps` could not write: a 5 000-digit integer, deep nesting)."""
    text = json.dumps({**doc, field: _HOLE}).encode()
    return text.replace(json.dumps(_HOLE).encode(), raw, 1)


def is_malformed(body: bytes, headers: dict[str, str] | None = None) -> bool:
    try:
        decode(body, headers)
    except MalformedMessage:
        return True
    except Exception:  # noqa: BLE001 - an untyped escape is exactly what must not happen
        return False
    return False


def draw_hostile(data: st.DataObject, run_id: str, attempt: int) -> Hostile:
    """One hostile message aimed at the model's run. Each is checked against the real decoder
    here, so a generator that made a valid (or an `unsupported_schema`) body fails as a bug of
    the model, not of the product."""
    kind = data.draw(st.sampled_from(["garbage", "huge_int", "deep", "wrong_type", "header"]))
    doc = message(run_id, attempt)
    headers: dict[str, str] = {}
    if kind == "garbage":
        body = data.draw(st.binary(max_size=64).filter(is_malformed) | st.sampled_from(NOT_OBJECTS))
    elif kind == "huge_int":
        field = data.draw(st.sampled_from(["attempt", "v", "tenant", "published_at", "surprise"]))
        body = inject(doc, field, b"9" * HUGE_DIGITS)
    elif kind == "deep":
        nested = b"[" * DEEP + b"]" * DEEP
        whole = data.draw(st.booleans())
        body = nested if whole else inject(doc, data.draw(st.sampled_from(list(doc))), nested)
    elif kind == "wrong_type":
        field = data.draw(st.sampled_from(sorted(WRONG_TYPES)))
        body = inject(doc, field, data.draw(st.sampled_from(WRONG_TYPES[field])))
    else:
        body = json.dumps(doc).encode()
        headers[HDR_ATTEMPT] = data.draw(
            st.sampled_from(["9" * HUGE_DIGITS, str(attempt + 1), "one", "", "\u00e9"])
        )
    if not is_malformed(body, headers):
        raise AssertionError(f"the model's hostile {kind} body is not malformed: {body[:80]!r}")
    return Hostile(kind, body, headers)
