"""Anthropic's Messages API on the HTTP front, beside OpenAI's and on the same engine:

    POST /v1/messages               a conversation -> the assistant's next Message, whole or streamed
    POST /v1/messages/count_tokens  a conversation -> {"input_tokens": N}, the prompt /v1/messages would run

A body (`anthropic_schema`) becomes the OpenAI API's chat request, so it is rendered and checked by the
front's one chat step (`HttpFront.accept_chat`) and run by its one generation step; its answer is Anthropic's
Message (`anthropic_responses`) and its errors are Anthropic's (`anthropic_errors`), naming the fields as
this API spells them. `anthropic-version` and `anthropic-beta` headers are accepted and change nothing.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.engine.errors import InvalidRequest
from service.fronts.call import Call
from service.fronts.field_names import FieldNames
from service.fronts.http.anthropic_responses import MessageBuilder
from service.fronts.http.anthropic_schema import CountTokensRequest, MessagesRequest
from service.fronts.http.chat_front import ChatFront
from service.fronts.http.request_body import read_body

# the chat request's field names (as the chat step names them) -> this API's
MESSAGES_NAMES = FieldNames({"stop": "stop_sequences", "chat_template_kwargs": "thinking",
                             "response_format.json_schema.schema": "output_config.format.schema"})


class MessagesApi:
    def __init__(self, front: ChatFront):
        self.front = front

    async def create(self, request: Request, call: Call) -> Response:
        body, size, model = await read_body(request, MessagesRequest, self.front.serving, call)
        try:
            accepted, reader, names = await self.front.accept_chat(request, model, body.chat(), size)
            builder = MessageBuilder(model.name, accepted, reader, model.facts.tokenizer, body.stop_sequences or [])
            return await self.front.generate(request, call, model, [accepted], builder, bool(body.stream), names)
        except InvalidRequest as e:
            raise MESSAGES_NAMES.renamed(e) from None

    async def count_tokens(self, request: Request, call: Call) -> Response:
        """The prompt's length in tokens, rendered as /v1/messages renders it: a conversation /v1/messages
        would refuse (one that leaves no room in the context, say) is refused here too."""
        body, size, model = await read_body(request, CountTokensRequest, self.front.serving, call)
        try:
            accepted, _, _ = await self.front.accept_chat(request, model, body.chat(), size)
        except InvalidRequest as e:
            raise MESSAGES_NAMES.renamed(e) from None
        call.finished("200", True)
        return JSONResponse({"input_tokens": len(accepted.request.prompt_token_ids)})
