"""The whole API fuzzed from its own OpenAPI document (issue 22: "no 5xx for any generated
input, no response that breaks its schema, no cross-tenant read"), with schemathesis against a
served API over a real nats-server and SQLite store. `max_examples` is kept small so CI stays
fast (`RUNFLEET_FUZZ_EXAMPLES` raises it for a longer run); the generated inputs still reach
every route, with valid and invalid bodies.

Each generated request is sent twice: with tenant `default`'s operate token (it owns the seeded
run and record, so refusals past the tenant check are reached too) and with tenant `b`'s,
once as generated and once aimed at `default`'s run or record — which must read as not found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from requests.structures import CaseInsensitiveDict
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.console.conftest import DOC, OP_A, OP_B
from tests.console.served import Seeded, ServedApi
from tests.support.nats_server import NatsServer

SCHEMA = schemathesis.openapi.from_dict(DOC)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def served(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    api = ServedApi(nats_server.url, tmp_path_factory.mktemp("served-api"))
    seeded = api.start()
    try:
        yield seeded
    finally:
        api.stop()


def call_as(case: schemathesis.Case[Any], served: Seeded, token: str) -> schemathesis.Response:
    """Send `case` with `token` (replacing any `Authorization` the generator made up; a case
    that tests a missing token has it removed again, and must get its 401) and check the
    answer against the document."""
    if case.headers is None:
        case.headers = CaseInsensitiveDict()
    case.headers["Authorization"] = f"Bearer {token}"
    response = case.call(base_url=served.url, timeout=30)
    case.validate_response(response, checks=CHECKS)
    return response


OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
"""One test per operation, each with its own node id: schemathesis's own `parametrize` gives
them all one, which pytest-xdist's `loadscope` then runs as one test (`./dev test`)."""


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_fuzzed_requests_get_no_5xx_a_schema_conforming_answer_and_no_other_tenants_data(
    operation: Any, served: Seeded
) -> None:
    # Valid and invalid inputs both, as schemathesis's own `parametrize` generates them.
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode))

    @given(case=cases)
    @settings(
        max_examples=int(os.environ.get("RUNFLEET_FUZZ_EXAMPLES", "12")),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case[Any]) -> None:
        fuzz_one(case, served)

    fuzz()


def fuzz_one(case: schemathesis.Case[Any], served: Seeded) -> None:
    as_b = call_as(case, served, OP_B)
    assert served.run_id not in as_b.text

    generated = dict(case.path_parameters or {})
    aimed = {"run_id": served.run_id, "record_id": served.record_id}
    if set(generated) & set(aimed):
        case.path_parameters = {**generated, **{k: aimed[k] for k in set(generated) & set(aimed)}}
        try:
            at_a = call_as(case, served, OP_B)
        finally:
            case.path_parameters = generated  # hypothesis may replay this case object
        # not found (or refused before it looked): never the run, its events or its record
        assert at_a.status_code in (400, 401, 404, 405, 415, 422), (
            case.path,
            at_a.status_code,
            at_a.text,
        )
        assert '"tenant"' not in at_a.text and "source_hash" not in at_a.text
        assert '"seq"' not in at_a.text and "max_deliveries" not in at_a.text

    call_as(case, served, OP_A)
