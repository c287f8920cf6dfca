"""How a failure reads over HTTP (SPEC v2.2 §10c): one table from the operations' typed errors
to a status, so every route answers alike.

The classification is the operations' own (`runner.operations.errors`, the one the CLI's exit
codes come from): a typed refusal is a 4xx whose body is the CLI's `--json` error
(`{"error": {"code", "message", "remedy"}}`, the same codes as exit 3); infrastructure that is
not there is 503 with `Retry-After`, because the caller's request was fine and will work once
NATS or the store is back; anything else is a 500 that names no internals.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from runner.operations.errors import is_refusal, is_unreachable, is_usage
from store import RunfleetError

RETRY_AFTER_S = 5
"""What `Retry-After` tells a caller when NATS or the store does not answer: about the time a
JetStream leader election or a store restart takes."""

REFUSAL_STATUS: dict[str, int] = {
    # the thing named does not exist (for this tenant)
    "run_not_found": 404,
    "record_not_found": 404,
    "upload_not_found": 404,
    # the run or record is not in a state that allows it
    "run_not_resumable": 409,
    "run_not_cancellable": 409,
    "run_busy": 409,
    "rewind_refused": 409,
    "stale_record": 409,
    "record_not_replayable": 409,
    "upload_in_use": 409,
    "workflow_source_changed": 409,
    "source_lacks_restart_node": 409,
    "scratch_not_portable": 409,
    "budget_below_consumed": 409,
    # the answers do not answer the questions
    "answers_required": 422,
    "answers_invalid": 422,
    # a retried launch that is not the request its key first made (the IETF idempotency-key draft)
    "idempotency_key_reused": 422,
    # a request larger than the queue can carry
    "resume_too_large": 413,
}
"""A refusal's status by code; a refusal not listed (a workflow that does not load, a var the
workflow does not declare, an ambiguous run id prefix, an upload that cannot be staged or
promoted as asked) is 400."""


class ApiError(Exception):
    """A request the API refuses before any operation runs: no or unknown token (401), a role
    that may not write (403), a body or parameter that does not parse (400), a route that does
    not exist (404, 405). Same body shape as a refusal."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        remedy: str | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.remedy = remedy
        self.headers = headers or {}

    def to_dict(self) -> dict[str, object]:
        # Every error body carries a remedy (docs/api.md): a caller's code may read it blindly.
        return {
            "code": self.code,
            "message": self.message,
            "remedy": self.remedy or DEFAULT_REMEDY.get(self.status, GENERIC_REMEDY),
        }


GENERIC_REMEDY = "correct the request as the message says (the API is described at /openapi.json)"
DEFAULT_REMEDY: dict[int, str] = {
    401: "send `Authorization: Bearer TOKEN` with a token from RUNFLEET_API_TOKENS (or the"
    " RUNFLEET_CONSOLE_TOKEN the fleet was started with)",
    403: "use a token whose role is `operate` for this call",
    404: "check the path against /openapi.json",
    405: "check the method against /openapi.json",
    413: "send a smaller body (a file goes through POST /api/v1/uploads)",
}
"""The remedy of an `ApiError` raised without one of its own, by status."""


def status_for(exc: RunfleetError) -> int:
    if is_unreachable(exc):
        return 503
    if is_refusal(exc):
        return REFUSAL_STATUS.get(exc.code, 400)
    if is_usage(exc):
        return 400  # runner.operations.errors: a usage error is the API's 400
    return 500


def error_json(
    status: int, body: dict[str, object], headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": body}, status=status, headers=headers, dumps=_dumps)


HTTP_WORDS: tuple[tuple[str, str], ...] = (
    ("--answer NAME=VALUE or --answers-file FILE", '`"answers": {"NAME": VALUE}` in the body'),
    ("pass --var name=value", 'send `"vars": {"name": value}`'),
    ("--accept-scratch-loss", '`"accept_scratch_loss": true`'),
    ("omit --file", 'omit `"workflow"`'),
    ("--force", '`"force": true`'),
    ("`runfleet status RUN`", "`GET /api/v1/runs/RUN`"),
    ("`runfleet runs`", "`GET /api/v1/runs`"),
    (" (`runfleet validate FILE` lists every problem at once)", ""),
    ("stage the files again", "stage the files again (`POST /api/v1/uploads`)"),
    ("`runfleet events RUN --follow`", "`GET /api/v1/runs/RUN/events/stream`"),
    ("`runfleet cancel RUN`", "`POST /api/v1/runs/RUN/cancel`"),
    ("`runfleet resume RUN`", "`POST /api/v1/runs/RUN/resume`"),
    ("`runfleet rewind RUN --node NODE`", "`POST /api/v1/runs/RUN/rewind`"),
    ("`runfleet launch FILE`", "`POST /api/v1/runs`"),
)
"""A refusal's remedy is written for the CLI, where most refusals are met; an HTTP caller
is told the body field or route that does the same (found by an operator walkthrough:
`answers_required` told an API client to pass `--answer`)."""


def http_remedy(remedy: str | None) -> str | None:
    if remedy is None:
        return None
    for cli, http in HTTP_WORDS:
        remedy = remedy.replace(cli, http)
    return remedy


def response_for(exc: RunfleetError | ApiError) -> web.Response:
    if isinstance(exc, ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        return error_json(exc.status, exc.to_dict(), {**headers, **exc.headers})
    status = status_for(exc)
    if status == 503:
        return error_json(status, exc.to_dict(), {"Retry-After": str(RETRY_AFTER_S)})
    if status == 500:
        return error_json(status, {"code": exc.code, "message": exc.message})
    body = exc.to_dict()
    if isinstance(body.get("remedy"), str):
        body["remedy"] = http_remedy(str(body["remedy"]))
    return error_json(status, body)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)
