"""The HTTP front's errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and a body's
type errors named as the request spells the field. The status of each engine error is
`service.fronts.status`'s; the engine's field names are renamed by `openai_names`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from service.engine.errors import InvalidRequest
from service.fronts.http.field_types import wrong_type
from service.fronts.status import HttpStatus

ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
               429: "rate_limit_exceeded", 503: "service_unavailable", 408: "timeout"}
TYPE_TAG = re.compile(r"[\[\](),]|^(str|int|float|bool|none|dict)$|^[A-Z]")  # pydantic's union member names


def error_body(status: HttpStatus) -> dict[str, Any]:
    return {"error": {"message": status.message, "type": status.type, "param": status.param,
                      "code": ERROR_CODES.get(status.status)}}


def error_response(status: HttpStatus) -> JSONResponse:
    return JSONResponse(error_body(status), status_code=status.status, headers=dict(status.headers))


def schema_error(error: ValidationError, schema: type[BaseModel], data: Any) -> InvalidRequest:
    """What is wrong with `data`, a body that `schema` refused, naming the field as the request spells it: a
    value of a JSON type its field does not take, told the type the field takes (`field_types`), found
    first because it is the common case and pydantic may list one error per item of a long array;
    else pydantic's first complaint."""
    wrong = wrong_type(schema, data)
    if wrong is not None:
        return InvalidRequest(wrong.path or "body", f"must be {wrong.expected}; got {_shown(wrong.value)}")
    err = error.errors()[0]
    path = ""
    for part in err["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not TYPE_TAG.search(part):
            path += ("." if path else "") + part
    if not path:
        return InvalidRequest("body", "must be a JSON object")
    if err["type"] == "extra_forbidden":
        return InvalidRequest(path, "is not a field this server implements; remove it (docs/api.md lists "
                              "every field and what the server does with it)")
    if err["type"] == "missing":
        return InvalidRequest(path, "is required")
    return InvalidRequest(path, f"{err['msg']}; got {_shown(err.get('input'))}")


def _shown(value: Any) -> str:
    shown = json.dumps(value, ensure_ascii=False, default=str)
    return shown if len(shown) <= 80 else shown[:77] + "..."


class HttpError(Exception):
    status: HttpStatus


class TooLarge(HttpError):
    def __init__(self, size: int, limit: int):
        super().__init__()
        self.status = HttpStatus(413, "invalid_request_error", f"the body is {size} bytes or more; the limit is "
                                 f"{limit} bytes (max_receive_message_bytes)", "body")


class BodyTimeout(HttpError):
    def __init__(self, size: int, limit_s: float):
        super().__init__()
        self.status = HttpStatus(408, "invalid_request_error", f"the body did not arrive within {limit_s:g} s of its "
                                 f"headers ({size} bytes did; body_timeout_s)", "body", (("Connection", "close"),))
