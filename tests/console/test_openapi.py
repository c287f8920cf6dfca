"""The OpenAPI 3.1 document (SPEC v2.2 §10c): served at `/openapi.json`, a valid 3.1 document,
generated from the models the routes use — every served route is in it with its models."""

from __future__ import annotations

from openapi_spec_validator import validate

from runner.console.api import ROUTES
from runner.console.models import LaunchRequest, RunOut
from tests.console.conftest import DOC, Api


async def test_openapi_json_is_the_generated_document_and_a_valid_openapi_3_1(api: Api) -> None:
    status, served, _ = await api.call("GET", "/openapi.json")

    assert status == 200 and served == DOC
    assert served["openapi"].startswith("3.1")
    validate(served)


def test_every_route_is_documented_with_the_models_it_validates_and_answers_with() -> None:
    schemas = DOC["components"]["schemas"]
    for route in ROUTES:
        op = DOC["paths"][route.path][route.method.lower()]
        assert op["operationId"] == route.operation_id
        assert {"400", "401", "500", "503"} <= set(op["responses"])
        assert ("403" in op["responses"]) == route.writes
        if route.body is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in schemas
    assert schemas["RunOut"]["required"] == [
        name for name, field in RunOut.model_fields.items() if field.is_required()
    ]
    assert set(schemas["LaunchRequest"]["properties"]) == set(LaunchRequest.model_fields)
    assert schemas["LaunchRequest"]["additionalProperties"] is False
