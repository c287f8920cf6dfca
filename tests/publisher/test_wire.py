"""The wire contract (SPEC §3): the versioned message, its headers, and strict decoding."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from publisher import (
    SCHEMA_VERSION,
    MalformedMessage,
    ResumeCopy,
    RunMessage,
    UnsupportedSchema,
    WireNames,
    decode,
    encode,
)
from store import Budget, Consents

SNAPSHOT = Path(__file__).with_name(f"run_message.v{SCHEMA_VERSION}.schema.json")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
RUN_ID = "0190f0e2-7c2a-7cc0-9a55-3c1d2b7e9f10"


def message(**overrides: Any) -> RunMessage:
    fields: dict[str, Any] = {
        "run_id": RUN_ID,
        "tenant": "acme",
        "attempt": 3,
        "kind": "resume",
        "published_at": datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
        "resume": ResumeCopy(
            answers={"approved": True},
            consents=Consents(force=True),
            budget=Budget(max_iterations=9),
            source_hash="a" * 64,
        ),
    }
    fields.update(overrides)
    return RunMessage(**fields)


def valid_body(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "v": 1,
        "run_id": RUN_ID,
        "tenant": "default",
        "attempt": 2,
        "kind": "launch",
        "published_at": "2025-01-02T03:04:05Z",
    }
    raw.update(overrides)
    return raw


def as_bytes(raw: Any) -> bytes:
    return json.dumps(raw).encode()


# -- encoding ---------------------------------------------------------------------------------


def test_encode_then_decode_round_trips_the_message():
    original = message()
    data, headers = encode(original)
    decoded = decode(data, headers)
    assert decoded == original
    assert decoded.published_at.tzinfo is not None


def test_body_carries_the_schema_version_and_the_contract_fields():
    data, _ = encode(message(kind="launch", resume=None, attempt=1))
    raw = json.loads(data)
    assert raw["v"] == SCHEMA_VERSION == 1
    assert {"v", "run_id", "tenant", "attempt", "kind", "published_at"} <= raw.keys()
    assert (raw["run_id"], raw["tenant"], raw["attempt"], raw["kind"]) == (
        RUN_ID,
        "acme",
        1,
        "launch",
    )


def test_msg_id_is_run_id_and_attempt():
    _, headers = encode(message(attempt=7))
    assert headers["Nats-Msg-Id"] == f"{RUN_ID}:7"


def test_a_new_attempt_gets_a_new_msg_id():
    _, first = encode(message(attempt=1))
    _, second = encode(message(attempt=2))
    assert first["Nats-Msg-Id"] != second["Nats-Msg-Id"]


def test_sweep_republish_msg_id_is_run_id_attempt_and_sweep_count():
    _, headers = encode(message(attempt=4), sweep=2)
    assert headers["Nats-Msg-Id"] == f"{RUN_ID}:4:s2"


def test_headers_carry_attempt_schema_and_traceparent():
    _, headers = encode(message(attempt=5), traceparent=TRACEPARENT)
    assert headers["Runfleet-Attempt"] == "5"
    assert headers["Runfleet-Schema"] == str(SCHEMA_VERSION)
    assert headers["traceparent"] == TRACEPARENT


def test_no_traceparent_header_without_a_trace():
    _, headers = encode(message())
    assert "traceparent" not in headers


def test_decode_accepts_a_message_without_headers():
    assert decode(as_bytes(valid_body())).attempt == 2


# -- strict decoding --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"not json", b"\xff\xfe\x00", b"{", b""],
    ids=["text", "not-utf8", "truncated", "empty"],
)
def test_decode_refuses_a_body_that_is_not_json(data: bytes):
    with pytest.raises(MalformedMessage, match="not JSON"):
        decode(data)


@pytest.mark.parametrize("raw", [[1, 2], "a string", 42, None], ids=["list", "str", "int", "null"])
def test_decode_refuses_a_body_that_is_not_an_object(raw: Any):
    with pytest.raises(MalformedMessage, match="not an object"):
        decode(as_bytes(raw))


def test_decode_refuses_an_extra_field():
    with pytest.raises(MalformedMessage, match="surprise"):
        decode(as_bytes(valid_body(surprise=1)))


@pytest.mark.parametrize("missing", ["run_id", "tenant", "attempt", "kind", "published_at"])
def test_decode_refuses_a_missing_field(missing: str):
    raw = valid_body()
    del raw[missing]
    with pytest.raises(MalformedMessage, match=missing):
        decode(as_bytes(raw))


@pytest.mark.parametrize("attempt", [0, -1])
def test_decode_refuses_an_attempt_below_one(attempt: int):
    with pytest.raises(MalformedMessage, match="attempt"):
        decode(as_bytes(valid_body(attempt=attempt)))


@pytest.mark.parametrize(("field", "value"), [("v", True), ("attempt", True), ("attempt", "2")])
def test_decode_refuses_a_schema_version_or_attempt_that_is_not_a_json_number(
    field: str, value: Any
):
    """Lax validation read `true` as 1: a `{"v": true}` body was acked as `settled`."""
    with pytest.raises(MalformedMessage, match=f"at {field}"):
        decode(as_bytes(valid_body(**{field: value})))


def test_decode_names_an_over_long_integer_as_such_not_as_json_that_does_not_parse():
    with pytest.raises(MalformedMessage) as refused:
        decode(b'{"v": ' + b"1" * 5000 + b"}")
    assert refused.value.message == "body holds an integer of more than 4 300 digits"


def test_decode_refuses_an_unknown_kind():
    with pytest.raises(MalformedMessage, match="kind"):
        decode(as_bytes(valid_body(kind="teleport")))


def test_decode_refuses_a_naive_published_at():
    with pytest.raises(MalformedMessage, match="published_at"):
        decode(as_bytes(valid_body(published_at="2025-01-02T03:04:05")))


def test_decode_refuses_a_header_attempt_that_disagrees_with_the_body():
    data, headers = encode(message(attempt=3))
    headers["Runfleet-Attempt"] = "4"
    with pytest.raises(MalformedMessage, match="disagrees"):
        decode(data, headers)


def test_decode_refuses_an_older_schema_version_as_malformed():
    with pytest.raises(MalformedMessage, match="at v:"):
        decode(as_bytes(valid_body(v=0)))


@pytest.mark.parametrize("newer", [SCHEMA_VERSION + 1, 99])
def test_a_newer_schema_version_is_unsupported_not_malformed(newer: int):
    # A rolling upgrade: the runner naks and waits instead of dead-lettering.
    with pytest.raises(UnsupportedSchema):
        decode(as_bytes(valid_body(v=newer, something_new=True)))


def test_a_newer_schema_version_is_unsupported_even_if_the_body_is_otherwise_invalid():
    with pytest.raises(UnsupportedSchema):
        decode(as_bytes({"v": SCHEMA_VERSION + 1}))


def test_malformed_and_unsupported_are_distinct_codes():
    assert MalformedMessage.code == "malformed"
    assert UnsupportedSchema.code == "unsupported_schema"
    assert not issubclass(UnsupportedSchema, MalformedMessage)


# -- names ------------------------------------------------------------------------------------


def test_production_names_are_those_of_the_contract():
    names = WireNames()
    assert names.runs_stream == "RUNFLEET_RUNS"
    assert names.runs_subject == "runfleet.runs"
    assert names.consumer == "runfleet-runners"
    assert names.advisory_stream == "RUNFLEET_ADVISORIES"
    assert names.advisory_subject == (
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.RUNFLEET_RUNS.runfleet-runners"
    )
    assert names.dlq_stream == "RUNFLEET_DLQ"
    assert names.dlq_subject(42) == "runfleet.dlq.42"
    assert names.control_subject(RUN_ID) == f"runfleet.control.{RUN_ID}"


def test_a_namespace_isolates_every_name():
    prod, ns = WireNames(), WireNames("Test_1")
    pairs = [
        (prod.runs_stream, ns.runs_stream),
        (prod.runs_subject, ns.runs_subject),
        (prod.consumer, ns.consumer),
        (prod.advisory_stream, ns.advisory_stream),
        (prod.advisory_subject, ns.advisory_subject),
        (prod.backstop_consumer, ns.backstop_consumer),
        (prod.dlq_stream, ns.dlq_stream),
        (prod.dlq_subject(1), ns.dlq_subject(1)),
        (prod.control_subject(RUN_ID), ns.control_subject(RUN_ID)),
    ]
    for a, b in pairs:
        assert a != b
    assert ns.advisory_subject.endswith(f"{ns.runs_stream}.{ns.consumer}")


# -- the schema is versioned ------------------------------------------------------------------


def _without_descriptions(schema: Any) -> Any:
    """Docstrings are not the contract: drop `description` so rewording one is not a change."""
    if isinstance(schema, dict):
        return {k: _without_descriptions(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_without_descriptions(v) for v in schema]
    return schema


def test_message_schema_change_requires_a_version_bump():
    current = _without_descriptions(RunMessage.model_json_schema())
    committed = json.loads(SNAPSHOT.read_text())
    assert current == committed, (
        f"RunMessage's JSON schema differs from the committed snapshot {SNAPSHOT.name}. "
        f"A change to the wire body must bump SCHEMA_VERSION (now {SCHEMA_VERSION}) and keep "
        "runners able to read the old version during a rolling upgrade; then commit a new "
        f"snapshot run_message.v{SCHEMA_VERSION + 1}.schema.json."
    )
    assert committed["properties"]["v"]["const"] == SCHEMA_VERSION
