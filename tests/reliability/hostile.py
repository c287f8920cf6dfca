"""Hostile bodies (SPEC v2.2 §5.2 step 1, §13.12): what a sender can put on the work subject to
make a decoder raise something other than its typed errors — integers past Python's
int-string limit (4 300 digits), nesting past the recursion limit (up to 200 000 levels),
strings of MiBs, wrong types at every field, bad UTF-8, lone surrogates, NaN and Infinity,
duplicate keys, a huge `v`, a huge or lying `Runfleet-Attempt` header.

One vocabulary, three users: the hypothesis strategies (`hostile_inputs`) for the pure `decode`
test, the fixed `NATS_BODIES` for the tests that go through a runner and the backstop, and
`random_hostile` (a seeded `random.Random`) for the poison fuzz and its long mode. A value is
written as raw JSON text into a valid message at a path (`inject`), because `json.dumps` cannot
write most of them (a 5 000-digit integer, NaN as a bare token, invalid UTF-8, a duplicate key).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from publisher.wire import HDR_ATTEMPT

INT_LIMIT = 4300
"""Python's default `sys.get_int_max_str_digits()`: `json.loads` raises `ValueError` beyond it."""
NATS_BODY_MAX = 1_000_200
"""Under the server's default `max_payload` (1 MiB) with room for the headers."""

PATHS: tuple[tuple[str, ...], ...] = (
    ("v",),
    ("run_id",),
    ("tenant",),
    ("attempt",),
    ("kind",),
    ("published_at",),
    ("resume",),
    ("resume", "answers"),
    ("resume", "answers", "q"),
    ("resume", "consents"),
    ("resume", "consents", "force"),
    ("resume", "budget"),
    ("resume", "budget", "max_iterations"),
    ("resume", "budget", "max_cost_usd"),
    ("resume", "source_hash"),
    ("surprise",),
)
"""Every field of `RunMessage` (and of its `resume` copy), plus an unknown one."""

_HOLE = "\x00hostile\x00"
_HOLE_JSON = json.dumps(_HOLE).encode()


def message(
    run_id: str = "r-1",
    *,
    tenant: str = "default",
    attempt: int = 1,
    published_at: str = "2026-01-01T00:00:00+00:00",
) -> dict[str, Any]:
    """A valid body (with a resume copy, so its nested fields exist to be broken)."""
    return {
        "v": 1,
        "run_id": run_id,
        "tenant": tenant,
        "attempt": attempt,
        "kind": "resume",
        "published_at": published_at,
        "resume": {
            "answers": {"q": "yes"},
            "consents": {"force": False},
            "budget": {"max_iterations": 3, "max_cost_usd": 1.5},
            "source_hash": "abc",
        },
    }


def inject(
    doc: dict[str, Any], path: tuple[str, ...], raw: bytes, *, duplicate: bool = False
) -> bytes:
    """`doc` as JSON with the value at `path` replaced by the raw JSON text `raw` (parents are
    created as needed). With `duplicate`, the original value stays and `raw` follows it under
    the same key: the last one wins in `json.loads`."""
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        if not isinstance(parent.get(key), dict):
            parent[key] = {}
        parent = parent[key]
    if duplicate and path[-1] in parent:
        original = json.dumps(parent.pop(path[-1]))
        parent[path[-1]] = _HOLE
        text = json.dumps(out).encode()
        name = json.dumps(path[-1]).encode()
        return text.replace(_HOLE_JSON, original.encode() + b", " + name + b": " + raw, 1)
    parent[path[-1]] = _HOLE
    return json.dumps(out).encode().replace(_HOLE_JSON, raw, 1)


# -- raw values -----------------------------------------------------------------------------------


def big_int(digits: int, *, negative: bool = False) -> bytes:
    return (b"-" if negative else b"") + b"1" + b"0" * (digits - 1)


def deep(depth: int, shape: str = "arrays") -> bytes:
    """`depth` nested arrays, objects, or both alternating, around a 0."""
    if shape == "arrays":
        return b"[" * depth + b"0" + b"]" * depth
    if shape == "objects":
        return b'{"":' * depth + b"0" + b"}" * depth
    pairs = depth // 2
    return b'[{"":' * pairs + b"0" + b"}]" * pairs


def huge_string(size: int, char: str = "x") -> bytes:
    return json.dumps(char * size).encode()


BAD_UTF8 = b'"\xff\xfe\xc0\x80\xed\xa0\x80"'
"""Never valid UTF-8 (0xff, an overlong NUL, an encoded surrogate) inside a JSON string."""
LONE_SURROGATE = b'"\\ud800x"'
TOKENS = (b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-0", b"null", b"true", b"[]", b"{}")


# -- hypothesis -----------------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

raw_values: st.SearchStrategy[bytes] = st.one_of(
    st.builds(
        big_int,
        st.sampled_from([20, 4000, INT_LIMIT, INT_LIMIT + 1, 5000, 20_000]) | st.integers(1, 6000),
        negative=st.booleans(),
    ),
    st.builds(
        deep,
        st.sampled_from([999, 1000, 2000, 200_000]) | st.integers(1, 3000),
        st.sampled_from(["arrays", "objects", "mixed"]),
    ),
    st.builds(
        huge_string,
        st.sampled_from([64 * 1024, 1024 * 1024, 3 * 1024 * 1024]) | st.integers(0, 5000),
        st.sampled_from(["x", "é", "\x00", "\ud7ff", "𝄞", '"', "\\"]),
    ),
    st.sampled_from([BAD_UTF8, LONE_SURROGATE, *TOKENS]),
    _json_values.map(lambda v: json.dumps(v).encode()),
)
"""Raw JSON text (or not quite JSON) for one value."""


@st.composite
def adversarial_json(draw: st.DrawFn) -> bytes:
    """A valid message with one hostile value at one path (or a duplicate key), or a hostile
    value as the whole body."""
    raw = draw(raw_values)
    if draw(st.integers(0, 9)) == 0:
        return raw
    doc = message(draw(st.text(min_size=1, max_size=30)), attempt=draw(st.integers(1, 10**6)))
    return inject(doc, draw(st.sampled_from(PATHS)), raw, duplicate=draw(st.booleans()))


attempt_headers: st.SearchStrategy[dict[str, str] | None] = st.one_of(
    st.none(),
    st.builds(lambda t: {HDR_ATTEMPT: t}, st.text(max_size=50)),
    st.builds(lambda n: {HDR_ATTEMPT: "9" * n}, st.integers(1, 5000)),
)

hostile_inputs: st.SearchStrategy[tuple[bytes, dict[str, str] | None]] = st.tuples(
    st.binary(max_size=4096) | adversarial_json(), attempt_headers
)
"""(body, headers) for `decode`: arbitrary bytes, or adversarial JSON, with an optional
`Runfleet-Attempt` header that may lie or be huge."""


# -- the fixed set for the NATS-backed tests ------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    name: str
    body: bytes


def nats_bodies() -> list[Hostile]:
    """Hostile bodies that fit a NATS message and are all `malformed`: each of them escaped
    `decode` as `ValueError`, `RecursionError` or `OverflowError` before v2.2, or is a type the
    validator must refuse."""
    m = message()
    out = [
        Hostile("int_5000_at_attempt", inject(m, ("attempt",), big_int(5000))),
        Hostile("int_5000_at_v", inject(m, ("v",), big_int(5000))),
        Hostile(
            "int_5000_at_budget", inject(m, ("resume", "budget", "max_iterations"), big_int(5000))
        ),
        Hostile("int_4000_at_published_at", inject(m, ("published_at",), big_int(4000))),
        Hostile("int_4000_negative_v", inject(m, ("v",), big_int(4000, negative=True))),
        Hostile("deep_200k_arrays", deep(200_000, "arrays")),
        Hostile("deep_200k_objects", deep(200_000, "objects")),
        Hostile("deep_200k_at_answers", inject(m, ("resume", "answers", "q"), deep(200_000))),
        Hostile("string_900k_at_kind", inject(m, ("kind",), huge_string(900 * 1024))),
        Hostile("bad_utf8_at_run_id", inject(m, ("run_id",), BAD_UTF8)),
        Hostile("lone_surrogate_at_tenant", inject(m, ("tenant",), LONE_SURROGATE)),
        Hostile("nan_at_attempt", inject(m, ("attempt",), b"NaN")),
        Hostile("duplicate_attempt_infinity", inject(m, ("attempt",), b"Infinity", duplicate=True)),
    ]
    assert all(len(h.body) <= NATS_BODY_MAX for h in out)
    return out


# -- seeded, for the poison fuzz ------------------------------------------------------------------


def random_hostile(rng: random.Random, doc: dict[str, Any], *, large: bool) -> tuple[str, bytes]:
    """(kind, body): `doc` with one hostile value, or a hostile whole body. Bodies over
    256 KiB (200 000-deep nesting, strings of hundreds of KiB) only when `large`: they cost
    disk and time, so the long mode rations them."""
    makers: list[tuple[str, Callable[[], bytes]]] = [
        (
            "int_huge",
            lambda: big_int(
                rng.choice([INT_LIMIT + 1, 5000, 6000, 20_000]), negative=rng.random() < 0.2
            ),
        ),
        ("int_4000", lambda: big_int(rng.choice([4000, INT_LIMIT]), negative=rng.random() < 0.2)),
        (
            "deep",
            lambda: deep(
                rng.choice([1500, 2000, 5000]), rng.choice(["arrays", "objects", "mixed"])
            ),
        ),
        ("bad_utf8", lambda: BAD_UTF8),
        ("surrogate", lambda: LONE_SURROGATE),
        ("token", lambda: rng.choice(TOKENS)),
        (
            "string",
            lambda: huge_string(rng.randrange(1000, 20_000), rng.choice(["x", "é", "\x00"])),
        ),
    ]
    if large:
        makers += [
            ("deep_200k", lambda: deep(200_000, rng.choice(["arrays", "objects"]))),
            ("string_big", lambda: huge_string(rng.randrange(300_000, 900_000))),
        ]
    kind, make = rng.choice(makers)
    raw = make()
    if rng.random() < 0.1:
        return f"hostile_{kind}_body", raw
    duplicate = rng.random() < 0.2
    path = rng.choice(PATHS)
    return f"hostile_{kind}", inject(doc, path, raw, duplicate=duplicate)
