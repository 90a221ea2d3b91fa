"""Domain errors to each protocol's status: the one table that decides what a client sees.

    error              gRPC                  HTTP   OpenAI error type
    InvalidRequest     INVALID_ARGUMENT      400    invalid_request_error   names the field and its allowed range
    Overloaded         RESOURCE_EXHAUSTED    429    rate_limit_error        retry-after-ms trailer / Retry-After header
    Unavailable        UNAVAILABLE           503    service_unavailable     still loading, or draining
    DeadlineExceeded   DEADLINE_EXCEEDED     408    timeout_error           the slot is already free
    Cancelled          CANCELLED             499    cancelled               the client went away
    ModelError, a bug  INTERNAL              500    server_error            logged with the request id

A deadline is the client's own (`timeout`), so it is a 408 and not a 5xx: nothing a client can send
makes the HTTP front answer 5xx but 503 (loading, draining) and a real fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from service.engine.errors import Cancelled, DeadlineExceeded, InvalidRequest, ModelError, Overloaded, Unavailable

RETRY_AFTER_KEY = "retry-after-ms"

CODES: tuple[tuple[type[Exception], grpc.StatusCode, int, str], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
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
        if isinstance(error, kind):
            trailing = ((RETRY_AFTER_KEY, str(retry_after_ms)),) if kind is Overloaded else ()
            return RpcStatus(code, str(error), trailing)
    return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def http_status_for(error: BaseException, retry_after_ms: int = 1000) -> HttpStatus:
    for kind, _, status, type_ in CODES:
        if isinstance(error, kind):
            param = error.field if isinstance(error, InvalidRequest) else None
            retry_after_s = max(1, math.ceil(retry_after_ms / 1000)) if kind is Overloaded else \
                1 if kind is Unavailable else None
            headers = (("Retry-After", str(retry_after_s)),) if retry_after_s else ()
            return HttpStatus(status, type_, str(error), param, headers)
    return HttpStatus(500, "server_error", f"internal error: {type(error).__name__}: {error}")
