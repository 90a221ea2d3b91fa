"""Domain errors to each protocol's status: the one table that decides what a client sees.

    error              gRPC                  HTTP   OpenAI error type
    InvalidRequest     INVALID_ARGUMENT      400    invalid_request_error   names the field and its allowed range
    UnknownModel       NOT_FOUND             404    invalid_request_error   names the models served (param: model)
    Forbidden          PERMISSION_DENIED     403    permission_error        an admin call the server does not allow
    Overloaded         RESOURCE_EXHAUSTED    429    rate_limit_error        retry-after-ms trailer / Retry-After header
    Unavailable        UNAVAILABLE           503    service_unavailable     still loading, or draining
    DeadlineExceeded   DEADLINE_EXCEEDED     408    timeout_error           the slot is already free
    Cancelled          CANCELLED             499    cancelled               the client went away
    ModelError, a bug  INTERNAL              500    server_error            logged with the request id

A deadline is the client's own (`timeout`), so it is a 408 and not a 5xx: nothing a client can send
makes the HTTP front answer 5xx but 503 (loading, draining) and a real fault.

A fault's message says what failed in the client's terms and names the request id to quote; its details
(exception text, a parser's state, a traceback) go to the log under that id, never to the client:

    internal error: the model call failed (request 7f3a...; the server's log has the details)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from service import logs
from service.engine.errors import (
    Cancelled,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    ModelError,
    Overloaded,
    Unavailable,
    UnknownModel,
)

RETRY_AFTER_KEY = "retry-after-ms"

CODES: tuple[tuple[type[Exception], grpc.StatusCode, int, str], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (UnknownModel, grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, 408, "timeout_error"),
    (Cancelled, grpc.StatusCode.CANCELLED, 499, "cancelled"),
    (ModelError, grpc.StatusCode.INTERNAL, 500, "server_error"),
)


@dataclass(frozen=True)
class RpcStatus:
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...] = ()

    @property
    def is_bug(self) -> bool:
        """INTERNAL: worth a stack trace in the log."""
        return self.code is grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class HttpStatus:
    status: int
    type: str  # OpenAI's error.type
    message: str
    param: str | None = None  # the offending request field, for a 400
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def is_bug(self) -> bool:
        return self.status >= 500 and self.status != 503


def status_for(error: BaseException, retry_after_ms: int = 1000) -> RpcStatus:
    for kind, code, _, _ in CODES:
        if isinstance(error, kind) and kind is not ModelError:
            trailing = ((RETRY_AFTER_KEY, str(retry_after_ms)),) if kind is Overloaded else ()
            return RpcStatus(code, str(error), trailing)
    return RpcStatus(grpc.StatusCode.INTERNAL, internal_message(error))


def http_status_for(error: BaseException, retry_after_ms: int = 1000) -> HttpStatus:
    for kind, _, status, type_ in CODES:
        if isinstance(error, kind) and kind is not ModelError:
            param = error.field if isinstance(error, InvalidRequest) else "model" if kind is UnknownModel else None
            retry_after_s = max(1, math.ceil(retry_after_ms / 1000)) if kind is Overloaded else \
                1 if kind is Unavailable else None
            headers = (("Retry-After", str(retry_after_s)),) if retry_after_s else ()
            return HttpStatus(status, type_, str(error), param, headers)
    return HttpStatus(500, "server_error", internal_message(error))


def internal_message(error: BaseException) -> str:
    """What a client is told of a fault: a ModelError's own message (written for clients), for anything else
    only that the server failed; and the request id (of the calling task's log context) to quote."""
    what = str(error) if isinstance(error, ModelError) else "the server failed this request"
    return f"internal error: {what} (request {logs.request_id.get()}; the server's log has the details)"


def internal_detail(error: BaseException) -> str:
    """What the log gets of a fault: everything."""
    detail = error.detail if isinstance(error, ModelError) else ""
    return f"{type(error).__name__}: {error}" + (f" ({detail})" if detail else "")
