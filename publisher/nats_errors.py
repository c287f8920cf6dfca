"""NATS errors → the runfleet tree (SPEC §10: code, cause, remedy; exit 4 when unreachable).

One table, so every operator surface tells a missing stream, a JetStream that does not answer and
a timeout apart the same way, and no nats-py exception type reaches a person untranslated.

The runner's loops call `DlqStore` and JetStream themselves and handle `nats.errors.Error` as
"retry shortly"; they keep meeting the raw types. Operator code translates at its boundary:
`translate_nats_error` for one exception, `nats_boundary()` around a block.

    nats-py                                          runfleet
    NoStreamResponseError (a publish nobody took)    StreamNotFound
    NotFoundError 10059 / 10014 (stream / consumer)  StreamNotFound
    ServiceUnavailableError (503), NoRespondersError JetStreamUnavailable
    nats / asyncio TimeoutError                      NatsTimeout
    closed, reconnecting, stale, no servers, OSError NatsUnavailable
    any other APIError or nats error                 NatsRequestFailed
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from publisher.errors import (
    JetStreamUnavailable,
    NatsRequestFailed,
    NatsTimeout,
    NatsUnavailable,
    StreamNotFound,
)
from store import RunfleetError

PUBLISH_RETRYABLE = (
    nats.errors.TimeoutError,
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    # No stream took the publish: JetStream restarting answers nothing for a moment (a stream
    # that is really gone fails every try, and the error names `runfleet streams ensure`).
    NoStreamResponseError,
    OSError,
)
"""The errors after which the publisher tries a publish again (with `msg_id_in_process`)."""
JETSTREAM_UNANSWERED = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    ServiceUnavailableError,
)
"""JetStream not answering for a moment: a leader election (a confirmed ack or a DLQ write
meets "no responders" while a consumer or stream elects, docs/reliability.md C5), a reconnect.
The runner's delivery says it at warning and disposes again; it is news, not a bug."""
MSG_ID_IN_PROCESS = 10158
"""JetStream's `409 "duplicate message id is in process"` (clustered streams, nats-server 2.15):
a copy under this `Nats-Msg-Id` is proposed to the stream's raft group and not yet committed.
Asked again a moment later, the answer is the duplicate with its sequence."""


def msg_id_in_process(exc: BaseException) -> bool:
    return isinstance(exc, APIError) and exc.err_code == MSG_ID_IN_PROCESS


def publish_retryable(exc: BaseException) -> bool:
    return isinstance(exc, PUBLISH_RETRYABLE) or msg_id_in_process(exc)


JS_CONSUMER_NOT_FOUND = 10014
JS_NO_MESSAGE_FOUND = 10037
JS_STREAM_NOT_FOUND = 10059

NATS_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, TimeoutError)
"""What a call into nats-py raises once connected (it also raises a bare `asyncio.TimeoutError`,
NOTES.md; connecting is translated in `publisher.connection`)."""

_DISCONNECTED = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
    nats.errors.OutboundBufferLimitError,
    OSError,
)


def is_stream_missing(exc: BaseException) -> bool:
    """A JetStream 404 for a stream or consumer (not "no message at that sequence")."""
    return isinstance(exc, NotFoundError) and getattr(exc, "err_code", None) in (
        JS_STREAM_NOT_FOUND,
        JS_CONSUMER_NOT_FOUND,
    )


def _api_text(exc: APIError) -> str:
    # Some subclasses (the key-value ones) never set the API fields: read them defensively.
    description = getattr(exc, "description", None) or str(exc) or type(exc).__name__
    status, err_code = getattr(exc, "code", None), getattr(exc, "err_code", None)
    return f"{description} (status {status}, error {err_code})"


def translate_nats_error(exc: BaseException, *, context: str = "") -> RunfleetError:
    """The typed error for `exc`; `context` (e.g. "publishing run X") prefixes the message."""
    prefix = f"{context}: " if context else ""
    if isinstance(exc, NoStreamResponseError):
        return StreamNotFound(
            f"{prefix}no stream took the message: the stream is missing, or JetStream is not"
            " enabled on the server"
        )
    if is_stream_missing(exc):
        assert isinstance(exc, APIError)
        return StreamNotFound(f"{prefix}{_api_text(exc)}")
    if isinstance(exc, ServiceUnavailableError):
        return JetStreamUnavailable(f"{prefix}JetStream is not available: {_api_text(exc)}")
    if isinstance(exc, nats.errors.NoRespondersError):
        return JetStreamUnavailable(f"{prefix}no JetStream server answered the request")
    if isinstance(exc, TimeoutError):  # nats.errors.TimeoutError is one too
        return NatsTimeout(f"{prefix}NATS did not answer in time ({type(exc).__name__})")
    if isinstance(exc, _DISCONNECTED):
        return NatsUnavailable(f"{prefix}the connection to NATS is gone: {exc!r}")
    if isinstance(exc, APIError):
        return NatsRequestFailed(f"{prefix}JetStream refused the request: {_api_text(exc)}")
    return NatsRequestFailed(f"{prefix}NATS error: {exc!r}")


@contextlib.contextmanager
def nats_boundary(context: str = "") -> Iterator[None]:
    """Translate any NATS error raised in the block (runfleet's own errors pass through)."""
    try:
        yield
    except RunfleetError:
        raise
    except NATS_ERRORS as exc:
        raise translate_nats_error(exc, context=context) from exc
