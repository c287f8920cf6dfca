"""The route table's parts (SPEC v2.2 §10c): what a route is, what a handler is given, and the
one wrapper that checks the role, parses the body and scopes the operations to the caller's
tenant before any handler runs.

Routes are data (`Route`) so that `openapi.py` documents exactly the routes `server.py` serves:
a route added here is in the document, with its body and response models, or it is not served.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from runner import operations as ops
from runner.console.auth import Principal, TokenSource, bearer
from runner.console.errors import ApiError
from runner.operations import Env
from store import RunDocument, RunNotFound

M = TypeVar("M", bound=BaseModel)

ENV = web.AppKey("runfleet.env", Env)
PRINCIPAL = web.RequestKey("runfleet.principal", Principal)
TOKENS = web.AppKey("runfleet.tokens", TokenSource)


def bearer_still_holds(request: web.Request) -> bool:
    """Whether the request's bearer token still maps to the principal it was let in as: a
    stream checks it as it goes, so a revoked token (or one moved to another tenant or role)
    ends the streams it opened (found by a security walkthrough: an events stream opened
    before a revocation kept sending the run's outputs)."""
    token = bearer(request.headers.get("Authorization"))
    now = request.app[TOKENS].book().lookup(token) if token is not None else None
    return now is not None and now == request.get(PRINCIPAL)


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["query", "path", "header"]
    schema: dict[str, Any]
    description: str = ""
    required: bool = False


@dataclass(frozen=True)
class Reply:
    model: BaseModel
    status: int = 200


@dataclass(frozen=True)
class Call:
    """One request, as a handler sees it: `env` acts for the caller's tenant only."""

    request: web.Request
    env: Env
    principal: Principal
    fleet_tenant: str
    """`RUNFLEET_TENANT` of the server: the owner of DLQ records no run can be found for."""
    body: BaseModel | None

    def parsed(self, model: type[M]) -> M:
        assert isinstance(self.body, model)
        return self.body

    def path(self, name: str) -> str:
        return self.request.match_info[name]

    def query_str(self, name: str) -> str | None:
        return self.request.query.get(name)

    def query_all(self, name: str) -> list[str]:
        return self.request.query.getall(name, [])

    def query_int(self, name: str, default: int, lo: int, hi: int) -> int:
        raw = self.request.query.get(name)
        return default if raw is None else parse_int(raw, name, lo, hi)


Handler = Callable[[Call], Awaitable[BaseModel | Reply | web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    operation_id: str
    summary: str
    handler: Handler
    response: type[BaseModel] | None
    """The 2xx body's model; None for a `text/event-stream` route."""
    body: type[BaseModel] | None = None
    params: tuple[Param, ...] = ()
    writes: bool = False
    status: int = 200
    also: tuple[int, ...] = ()
    """Statuses this route can answer besides 200/`status`, 400, 401, 403, 500 and 503."""
    raw_body: bool = False
    """The body is the bytes of a file (`application/octet-stream`), read by the handler."""


def invalid(message: str, remedy: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, remedy)


def parse_int(raw: str, name: str, lo: int, hi: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"{name}: {raw[:40]!r} is not an integer") from None
    if not lo <= value <= hi:
        raise invalid(f"{name}: {value} is outside {lo}..{hi}")
    return value


def scoped(env: Env, tenant: str) -> Env:
    """`env` acting for `tenant`: every operation's default tenant (run id prefixes, listings,
    launch, resume, cancel, replay) becomes the caller's."""
    return dataclasses.replace(env, settings=env.settings.model_copy(update={"tenant": tenant}))


def _problems(exc: ValidationError) -> str:
    shown = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        shown.append(f"{where}: {err['msg']}")
    more = len(exc.errors()) - len(shown)
    return "; ".join(shown) + (f" (and {more} more)" if more > 0 else "")


JSON_TYPES = ("application/json",)


def check_query(request: web.Request, route: Route) -> None:
    """A query parameter the route does not take is refused, not ignored: `?stauts=failed`
    would otherwise list every run, and the caller would take the list for an answer."""
    known = [p.name for p in route.params if p.where == "query"]
    unknown = sorted(set(request.query) - set(known))
    if unknown:
        takes = ", ".join(known) if known else "none"
        raise invalid(
            f"unknown query parameter {unknown[0][:40]!r}",
            f"this route's query parameters: {takes} (see /openapi.json)",
        )


def check_json_type(request: web.Request) -> None:
    """A body sent as another media type (`text/plain`, a form: curl's `-d` without `-H`) is
    415, not read as JSON anyway; a body with no `Content-Type` at all is read as JSON."""
    if "Content-Type" not in request.headers:
        return
    kind = request.content_type
    if kind in JSON_TYPES or kind.endswith("+json"):
        return
    raise ApiError(
        415,
        "unsupported_media_type",
        f"the body is {kind[:60]}, not JSON",
        "send the body as JSON with `Content-Type: application/json`",
    )


async def parse_body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    check_json_type(request)
    raw = await request.read()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise invalid("the body is not JSON", "send a JSON object") from None
    except RecursionError:  # `[[[[…` deeper than the parser's stack
        raise invalid("the body's JSON is nested too deeply", "send a JSON object") from None
    if not isinstance(data, dict):
        raise invalid("the body is not a JSON object", "send a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(_problems(exc)) from None


def endpoint(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler for `route`: role check, body, tenant scope, then the handler."""

    async def handle(request: web.Request) -> web.StreamResponse:
        principal = request[PRINCIPAL]
        if route.writes and not principal.may_write:
            raise ApiError(
                403,
                "forbidden",
                f"a {principal.role} token may not {route.summary.lower()}",
                "use a token with the operate role",
            )
        check_query(request, route)
        body = await parse_body(request, route.body) if route.body is not None else None
        env = request.app[ENV]
        call = Call(request, scoped(env, principal.tenant), principal, env.tenant, body)
        out = await route.handler(call)
        if isinstance(out, web.StreamResponse):
            return out
        reply = out if isinstance(out, Reply) else Reply(out, route.status)
        return web.Response(
            text=reply.model.model_dump_json(), status=reply.status, content_type="application/json"
        )

    return handle


async def owned_run(call: Call, given: str) -> RunDocument:
    """The caller's run `given` names (its id or a unique prefix): another tenant's is not
    found."""
    doc = await ops.get_run(call.env, given)
    if doc.tenant != call.principal.tenant:
        raise RunNotFound(f"no run {given!r}")
    return doc
