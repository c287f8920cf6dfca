"""The DLQ routes' filters (SPEC §3 records, v2.2 §10c): a `reason` the fleet never writes is a
typed 400 naming it and the reasons accepted, as a malformed `older_than` is (before, it answered
an empty list, or replayed and purged nothing, as if all were well); and the filters narrow
`all: true` only — beside `ids` they are refused, not silently dropped."""

from __future__ import annotations

from typing import Any

import pytest

from runner.operations.dlq import DLQ_REASONS
from tests.console.conftest import Api
from tests.operations.test_dlq import ids_left, poison


def names_the_reasons(body: dict[str, Any]) -> bool:
    message = str(body["error"]["message"])
    return "reason" in message and "'bogus'" in message and all(r in message for r in DLQ_REASONS)


async def test_a_reason_the_fleet_never_writes_is_a_typed_400_naming_the_accepted_ones(
    api: Api,
) -> None:
    await poison(api.fleet.dlq, 31)

    status, body, _ = await api.call("GET", "/api/v1/dlq", params={"reason": "bogus"})
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert names_the_reasons(body), body
    for route in ("/api/v1/dlq/replay", "/api/v1/dlq/purge"):
        status, body, _ = await api.call("POST", route, json={"all": True, "reason": "bogus"})
        assert status == 400 and body["error"]["code"] == "invalid_request", (route, body)
        assert names_the_reasons(body), body

    status, listed, _ = await api.call("GET", "/api/v1/dlq", params={"reason": "malformed"})
    assert status == 200 and [r["id"] for r in listed["records"]] == [31]
    assert await ids_left(api.fleet.dlq) == [31]


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("/api/v1/dlq/replay", {"reason": "malformed"}),
        ("/api/v1/dlq/purge", {"reason": "malformed"}),
        ("/api/v1/dlq/purge", {"older_than": "1s"}),
    ],
    ids=["replay-reason", "purge-reason", "purge-older-than"],
)
async def test_a_filter_beside_ids_is_a_typed_400_not_dropped(
    api: Api, route: str, extra: dict[str, str]
) -> None:
    await poison(api.fleet.dlq, 32)

    status, body, _ = await api.call("POST", route, json={"ids": [32], **extra})

    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert next(iter(extra)) in body["error"]["message"] and "ids" in body["error"]["message"]
    assert await ids_left(api.fleet.dlq) == [32]
