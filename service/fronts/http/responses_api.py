"""OpenAI's Responses API on the HTTP front, stateless:

    POST   /v1/responses          a Response to `input`: served as a chat request (`HttpFront.accept_chat`), so
                                  with the same template, tools, constraint and checks; whole or streamed
    GET    /v1/responses/{id}     404: nothing is stored
    DELETE /v1/responses/{id}     404: nothing is stored

The request is `responses_schema`'s, the answer `responses_body`'s; errors have OpenAI's shape and name the
fields as the Responses request spells them.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.engine.errors import InvalidRequest
from service.fronts.call import Call
from service.fronts.http.chat_front import ChatFront
from service.fronts.http.errors import HttpError
from service.fronts.http.request_body import read_body
from service.fronts.http.responses_body import ResponsesBody
from service.fronts.http.responses_schema import REASONING, STATELESS, ResponsesRequest, responses_error
from service.fronts.status import HttpStatus


async def create(front: ChatFront, request: Request, call: Call) -> Response:
    body, size, model = await read_body(request, ResponsesRequest, front.serving, call)
    try:
        accepted, reader, names = await front.accept_chat(request, model, body.chat_request(), size)
        builder = ResponsesBody(model.name, accepted, reader, body.echo(), model.texts, body.included(REASONING))
        return await front.generate(request, call, model, [accepted], builder, bool(body.stream), names)
    except InvalidRequest as e:
        raise responses_error(e) from None


async def not_stored(request: Request, call: Call) -> Response:
    raise NotStored(request.path_params["response_id"])


class NotStored(HttpError):
    def __init__(self, response_id: str):
        super().__init__()
        self.status = HttpStatus(404, "invalid_request_error", f"no response {response_id!r} is stored: {STATELESS}",
                                 "response_id")
