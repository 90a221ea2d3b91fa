"""`ChatFront`: what the chat APIs served as a chat request (Anthropic's Messages, OpenAI's Responses) take of the
HTTP front (`HttpFront`): its serving context, its chat step and its generation step."""

from __future__ import annotations

from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from service.fronts.call import Call
from service.fronts.chat_output import OutputReader
from service.fronts.field_names import FieldNames
from service.fronts.http.openai_schema import ChatCompletionRequest
from service.fronts.http.response_streams import BodyBuilder
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext
from service.fronts.validation import AcceptedRequest


class ChatFront(Protocol):
    serving: ServingContext

    async def accept_chat(self, request: Request, model: ModelContext, body: ChatCompletionRequest, size: int
                          ) -> tuple[AcceptedRequest, OutputReader | None, FieldNames]: ...

    async def generate(self, request: Request, call: Call, model: ModelContext,
                       accepted_requests: list[AcceptedRequest], builder: BodyBuilder, stream: bool,
                       names: FieldNames) -> Response: ...
