"""The HTTP front's errors in Anthropic's shape, for the Messages API's routes:
`{"type": "error", "error": {"type": ..., "message": ...}}`.

An error is decided once, as an `HttpStatus` (`service.fronts.status`, the same table as every other route);
this only spells it as Anthropic does. The message names the field first, as on every route
(`max_tokens: ...`). Two statuses change on the way: the server's full queue (429 elsewhere) is Anthropic's
529 `overloaded_error`, since it is this server, not the client's quota, that is full; loading and draining
stay 503, also `overloaded_error`. Either way `Retry-After` says when to try again.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from service.fronts.status import HttpStatus

OVERLOADED = 529  # Anthropic's status for an API that is overloaded
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", OVERLOADED: "overloaded_error"}


def anthropic_status(status: HttpStatus) -> int:
    """The HTTP status an Anthropic client gets for `status`: a full queue is 529, the rest unchanged."""
    return OVERLOADED if status.status == 429 else status.status


def anthropic_error_body(status: HttpStatus) -> dict[str, Any]:
    kind = ERROR_TYPES.get(anthropic_status(status), "api_error")
    return {"type": "error", "error": {"type": kind, "message": status.message}}


def anthropic_error_response(status: HttpStatus) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status), status_code=anthropic_status(status),
                        headers=dict(status.headers))
