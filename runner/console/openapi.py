"""The OpenAPI 3.1 document (SPEC v2.2 §10c), assembled from the route table and the pydantic
models the routes validate and answer with: nothing here is written twice, so a route or a
field cannot be served without being documented, or documented differently.

OpenAPI 3.1's schema dialect is JSON Schema 2020-12, which is what pydantic emits; the models'
`$defs` become `components/schemas`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from runner.console.models import ErrorResponse, Health, Readiness
from runner.console.routing import Route

REF = "#/components/schemas/{model}"
Refs = Mapping[Any, dict[str, Any]]
TITLE = "runfleet HTTP API"
VERSION = "1"

SSE_EVENT: dict[str, Any] = {
    "description": "one server-sent event: `message` (data: an EventOut), then `end` (data: the"
    " run, a RunOut) or `error` (data: an ErrorResponse)",
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"enum": ["message", "end", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json"},
        "id": {"type": "string"},
    },
}

_ERRORS: dict[int, str] = {
    400: "invalid request, or a refusal with no more specific status",
    401: "no token, or an unknown one",
    403: "a read token asked to write",
    404: "not found (another tenant's run or record is not found either)",
    409: "the run or record is not in a state that allows it",
    415: "the body is not sent as JSON (`Content-Type: application/json`)",
    422: "the answers do not answer the pending questions, or an Idempotency-Key came back with"
    " another launch",
    500: "an internal error",
    503: "NATS or the store is unreachable; retry after Retry-After seconds",
}


def _models(routes: tuple[Route, ...]) -> list[tuple[type[BaseModel], JsonSchemaMode]]:
    pairs: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (ErrorResponse, "serialization"),
        (Health, "serialization"),
        (Readiness, "serialization"),
    ]
    for route in routes:
        if route.body is not None:
            pairs.append((route.body, "validation"))
        if route.response is not None:
            pairs.append((route.response, "serialization"))
    return list(dict.fromkeys(pairs))


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error_response(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": _ERRORS[status],
        "content": _json({"$ref": REF.format(model="ErrorResponse")}),
    }
    if status == 503:
        out["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out


def _operation(route: Route, refs: Refs) -> dict[str, Any]:
    ok: dict[str, Any]
    if route.response is None:
        ok = {
            "description": "a text/event-stream of the run's events, then `end` (or `error`)",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        }
    else:
        ok = {
            "description": route.summary,
            "content": _json(refs[(route.response, "serialization")]),
        }
    responses: dict[str, Any] = {str(route.status): ok}
    for status in route.also:
        if status in _ERRORS:
            responses[str(status)] = _error_response(status)
        else:
            responses[str(status)] = ok
    errors = [400, 401, 500, 503] + ([403] if route.writes else [])
    errors += [415] if route.body is not None else []
    for status in errors:
        responses[str(status)] = _error_response(status)
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "security": [{"bearer": []}],
        "x-runfleet-role": "operate" if route.writes else "read",
        "parameters": [
            {
                "name": p.name,
                "in": p.where,
                "required": p.required,
                "schema": p.schema,
                **({"description": p.description} if p.description else {}),
                **({"style": "form", "explode": True} if p.schema.get("type") == "array" else {}),
            }
            for p in route.params
        ],
        "responses": dict(sorted(responses.items())),
    }
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": _json(refs[(route.body, "validation")])}
    if route.raw_body:
        binary = {"type": "string", "contentMediaType": "application/octet-stream"}
        op["requestBody"] = {
            "required": True,
            "content": {"application/octet-stream": {"schema": binary}},
        }
    return op


def document(routes: tuple[Route, ...]) -> dict[str, Any]:
    pairs = _models(routes)
    refs, defs = models_json_schema(pairs, ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, refs)
    method: Literal["get"] = "get"
    paths["/healthz"] = {
        method: {
            "operationId": "healthz",
            "summary": "Liveness (no token needed)",
            "security": [],
            "responses": {
                "200": {"description": "up", "content": _json({"$ref": REF.format(model="Health")})}
            },
        }
    }
    paths["/readyz"] = {
        method: {
            "operationId": "readyz",
            "summary": "Readiness: NATS and the store answer (no token needed)",
            "security": [],
            "responses": {
                status: {
                    "description": what,
                    "content": _json({"$ref": REF.format(model="Readiness")}),
                }
                for status, what in (("200", "ready"), ("503", "not ready: `problems` says why"))
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": VERSION},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
