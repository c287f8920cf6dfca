"""The operator console's server and the HTTP API (SPEC v2.2 §10b, §10c): routes over
`runner.operations` (never a second implementation of an operation), bearer-token auth bound to
a tenant and a role, and an OpenAPI 3.1 document generated from the same pydantic models.

    server   create_app (an aiohttp app over an open Env), serve (`runfleet console`)
    api      the run routes and the route table (ROUTES); dlq_api the DLQ's
    auth     tokens → (tenant, role)          errors   refusal → status, one table
    models   request and response bodies      openapi  the document, from ROUTES and models
"""

from runner.console.auth import Principal, TokenBook, load_tokens
from runner.console.server import DEFAULT_HOST, DEFAULT_PORT, create_app, serve

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "Principal",
    "TokenBook",
    "create_app",
    "load_tokens",
    "serve",
]
