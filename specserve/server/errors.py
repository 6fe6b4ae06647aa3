"""The one table that maps failures to gRPC status codes and HTTP error objects.

Both front ends raise or catch the same exceptions and look them up here, so a
bad ``top_p`` is INVALID_ARGUMENT on gRPC exactly when it is 400 on HTTP.

=====================  ===================  ====  =========================  =====================
failure                gRPC                 HTTP  OpenAI ``type``            ``code``
=====================  ===================  ====  =========================  =====================
InvalidRequestError    INVALID_ARGUMENT     400   invalid_request_error      invalid_value
UnknownModelError      NOT_FOUND            404   invalid_request_error      model_not_found
UnauthenticatedError   UNAUTHENTICATED      401   authentication_error       invalid_api_key
QueueFullError         RESOURCE_EXHAUSTED   429   rate_limit_error           queue_full
EngineDrainingError    UNAVAILABLE          503   service_unavailable_error  server_draining
DeadlineExceededError  DEADLINE_EXCEEDED    504   timeout_error              deadline_exceeded
RequestFailedError     INTERNAL             500   internal_error             request_failed
EngineDeadError        INTERNAL             500   internal_error             engine_dead
anything else          INTERNAL             500   internal_error             internal_error
=====================  ===================  ====  =========================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from specserve.errors import (
    EngineDeadError,
    EngineDrainingError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    SpecServeError,
)


class UnknownModelError(SpecServeError):
    """The request names a model this server does not serve."""

    def __init__(self, requested: str, served: str):
        self.field = "model"
        super().__init__(f"model: {requested!r} does not exist; this server serves {served!r}")


class UnauthenticatedError(SpecServeError):
    """The API key is missing or wrong."""


class DeadlineExceededError(SpecServeError):
    """The client's deadline passed before the request finished; it was aborted."""


class EngineRequestError(EngineDeadError):
    """The engine failed this request (``RequestOutput.error``)."""


@dataclass(frozen=True)
class ErrorKind:
    name: str  # short name for logs, metrics labels and the load generator
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    code: str


INVALID = ErrorKind("invalid_argument", grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_value")
NOT_FOUND = ErrorKind("model_not_found", grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found")
UNAUTHENTICATED = ErrorKind(
    "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "invalid_api_key"
)
QUEUE_FULL = ErrorKind("queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "queue_full")
DRAINING = ErrorKind("draining", grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", "server_draining")
DEADLINE = ErrorKind("deadline_exceeded", grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", "deadline_exceeded")
REQUEST_FAILED = ErrorKind(
    "request_failed", grpc.StatusCode.INTERNAL, 500, "internal_error", "request_failed"
)
ENGINE_DEAD = ErrorKind("engine_dead", grpc.StatusCode.INTERNAL, 500, "internal_error", "engine_dead")
INTERNAL = ErrorKind("internal", grpc.StatusCode.INTERNAL, 500, "internal_error", "internal_error")

# Most specific first: EngineRequestError is an EngineDeadError.
_TABLE: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (InvalidRequestError, INVALID),
    (UnknownModelError, NOT_FOUND),
    (UnauthenticatedError, UNAUTHENTICATED),
    (QueueFullError, QUEUE_FULL),
    (EngineDrainingError, DRAINING),
    (DeadlineExceededError, DEADLINE),
    (RequestFailedError, REQUEST_FAILED),
    (EngineDeadError, ENGINE_DEAD),
)


def classify(exc: BaseException) -> ErrorKind:
    for cls, kind in _TABLE:
        if isinstance(exc, cls):
            return kind
    return INTERNAL


def public_message(exc: BaseException) -> str:
    """The text sent to the client: our own errors verbatim, anything else generic."""
    if isinstance(exc, SpecServeError):
        return str(exc)
    return f"internal error ({type(exc).__name__}); see the server log"


def error_param(exc: BaseException) -> str | None:
    return getattr(exc, "field", None)


def openai_error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI-style ``{"error": {message, type, param, code}}``)."""
    kind = classify(exc)
    body = {
        "error": {
            "message": public_message(exc),
            "type": kind.openai_type,
            "param": error_param(exc),
            "code": kind.code,
        }
    }
    return kind.http_status, body
