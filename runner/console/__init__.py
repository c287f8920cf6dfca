"""The operator console's server and the HTTP API (SPEC v2.2 §10b, §10c): routes over
`runner.operations` (never a second implementation of an operation), bearer-token auth bound to
a tenant and a role, and an OpenAPI 3.1 document generated from the same pydantic models.

    server   create_app (an aiohttp app over an open Env), serve (`runfleet console`)
    api      the run routes and the route table (ROUTES); dlq_api the DLQ's
    auth     tokens → (tenant, role)          errors   refusal → status, one table
    models   request and response bodies      openapi  the document, from ROUTES and models

Its names are imported when first used (`__init__.pyi` lists them; ADR-0024): a CLI command
that never publishes does not pay for importing NATS and the S3 client.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
