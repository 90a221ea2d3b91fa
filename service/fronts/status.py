"""Domain errors to gRPC status codes: the one place that decides what a client sees.

    InvalidRequest     -> INVALID_ARGUMENT     the message names the field and its allowed range
    Overloaded         -> RESOURCE_EXHAUSTED   with `retry-after-ms` in the trailing metadata
    Unavailable        -> UNAVAILABLE          still loading, or draining: another replica may serve it
    DeadlineExceeded   -> DEADLINE_EXCEEDED    the slot is already free
    Cancelled          -> CANCELLED
    ModelError, a bug  -> INTERNAL             logged with the request id; other requests are unaffected
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from service.engine.errors import Cancelled, DeadlineExceeded, InvalidRequest, ModelError, Overloaded, Unavailable

RETRY_AFTER_KEY = "retry-after-ms"

CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (ModelError, grpc.StatusCode.INTERNAL),
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


def status_for(error: BaseException, retry_after_ms: int = 1000) -> RpcStatus:
    for kind, code in CODES:
        if isinstance(error, kind):
            trailing = ((RETRY_AFTER_KEY, str(retry_after_ms)),) if kind is Overloaded else ()
            return RpcStatus(code, str(error), trailing)
    return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
