"""The HTTP front: OpenAI's API on the engine, as a Starlette application.

    POST /v1/completions        prompt: a string, a list of strings, a list of token ids (or of lists)
    POST /v1/chat/completions   messages rendered with the model's chat template
    POST /v1/responses          OpenAI's Responses API, stateless, served as a chat request (`responses_api`)
    GET  /v1/models             the served models, under their served names (the bundles' unless served_model_name)
    POST /v1/messages           Anthropic's Messages API (and /v1/messages/count_tokens): `anthropic_messages`
    POST /tokenize, /detokenize vLLM's: a text or a chat to token ids, and back (`tokenize`)
    GET  /health                200 while serving, 503 while loading or draining (no token needed); each model's state

The routes and their answers. A request's `model` picks the model that runs it (none: the default, the first
bundle's; one not served: 404). A request's body is read and bounded by `request_body`, checked by the
rules every front shares (`service.fronts.validation`), and every error has OpenAI's shape (`errors`), or
Anthropic's on its routes (`anthropic_errors`); the bearer token is checked before any of it
(`bearer_guard`). Nothing a client sends gives a 500.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service import logs
from service.engine.errors import InvalidRequest, Overloaded
from service.fronts.call import Call
from service.fronts.chat_output import OutputReader, output_reader
from service.fronts.field_names import FieldNames
from service.fronts.generation import ClientGone, Generation
from service.fronts.http import json_body, responses_api
from service.fronts.http.anthropic_errors import anthropic_error_response
from service.fronts.http.anthropic_messages import MessagesApi
from service.fronts.http.bearer_guard import BearerGuard
from service.fronts.http.chat_prompt import render_prompt
from service.fronts.http.errors import HttpError, error_response
from service.fronts.http.models_api import ModelsApi
from service.fronts.http.openai_names import chat_names, completion_names
from service.fronts.http.openai_responses import ChatBuilder, CompletionBuilder, ResponseBuilder
from service.fronts.http.openai_schema import ChatCompletionRequest, CompletionRequest, SamplingFields
from service.fronts.http.request_body import header_timeout, read_body
from service.fronts.http.response_streams import BodyBuilder, SSEResponse, json_pieces
from service.fronts.http.structured import after_reasoning, constraint_of
from service.fronts.http.tokenize import Tokenization
from service.fronts.model_context import ModelContext
from service.fronts.reasoning import output_start
from service.fronts.serving_context import ServingContext
from service.fronts.status import HttpStatus, http_status_for, internal_detail
from service.fronts.validation import AcceptedRequest, accept, usable_prompt_ids
from service.runtime.chat_template import ChatTemplate, ChatTemplateError

log = logging.getLogger("attnserve.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the engine's
LARGE_RESPONSE_ENTRIES = 16384  # tokens and logprob alternatives past which a response is encoded a choice at a time
OFF_LOOP_PROMPTS = 8  # a completions request with more prompts is checked and tokenized in a worker thread
T = TypeVar("T")


class HttpFront:
    def __init__(self, serving: ServingContext, token: str | None = None):
        self.serving = serving
        tokenization = Tokenization(serving, self._chat_template)
        models = ModelsApi(serving)
        routes = [
            self._route("POST", "/v1/completions", self.completions),
            self._route("POST", "/v1/chat/completions", self.chat_completions),
            self._route("POST", "/v1/responses", functools.partial(responses_api.create, self)),
            self._route("GET", "/v1/responses/{response_id}", responses_api.not_stored),
            self._route("DELETE", "/v1/responses/{response_id}", responses_api.not_stored),
            self._route("GET", "/v1/models", models.list),
            self._route("GET", "/v1/models/{model:path}", models.one),
            self._route("POST", "/tokenize", tokenization.tokenize),
            self._route("POST", "/detokenize", tokenization.detokenize),
            self._route("POST", "/models/load", models.load),
            self._route("POST", "/models/unload", models.unload),
            Route("/health", self.health, methods=["GET"]),
        ]
        messages = MessagesApi(self)
        routes += [self._route("POST", "/v1/messages", messages.create, errors=anthropic_error_response),
                   self._route("POST", "/v1/messages/count_tokens", messages.count_tokens,
                               errors=anthropic_error_response)]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})
        self.app = BearerGuard(app, token, serving)

    def _route(self, method: str, path: str, handler: Callable[[Request, Call], Awaitable[Response]],
               errors: Callable[[HttpStatus], Response] = error_response) -> Route:
        """A counted endpoint: its call is measured under `path` (parameters unnamed by type), and whatever
        `handler` raises becomes the error response, in the shape `errors` gives it (OpenAI's by default)."""
        label = re.sub(r":\w+}", "}", path)

        async def endpoint(request: Request) -> Response:
            call = Call(self.serving, "http", label)
            try:
                return await handler(request, call)
            except Exception as e:
                return self._failed(call, e, errors)

        return Route(path, endpoint, methods=[method])

    # ---- endpoints ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        s = self.serving
        status = "serving" if s.taking_work else "draining" if s.opened else "loading"
        models = {model.name: model.state for model in s.models.values()}
        return JSONResponse({"status": status, "models": models}, status_code=200 if s.taking_work else 503)

    async def completions(self, request: Request, call: Call) -> Response:
        body, size, model = await read_body(request, CompletionRequest, self.serving, call)
        facts = model.facts
        constraint, constraint_field = constraint_of(body)
        names = completion_names(constraint_field)
        prompts = body.prompts()

        def accept_all() -> list[AcceptedRequest]:
            accepted_requests = []
            for prompt in prompts:
                if isinstance(prompt, str):
                    text, ids = prompt, []
                else:
                    text, ids = "", usable_prompt_ids(prompt, False, facts)
                fields = {"prompt": text, "prompt_token_ids": ids, "n": 1 if body.n is None else body.n,
                          "top_logprobs": body.logprobs or 0, "logprobs": body.logprobs is not None,
                          "echo": bool(body.echo), "constraint": constraint,
                          "prompt_logprobs": body.logprobs if body.echo else None}
                accepted_requests.append(self._accept(model, fields, body, body.max_tokens,
                                                      COMPLETIONS_DEFAULT_MAX_TOKENS, names, request))
            return accepted_requests

        heavy = size > json_body.OFF_LOOP_BYTES or len(prompts) > OFF_LOOP_PROMPTS
        accepted_requests = await _off_loop(heavy, accept_all)
        logs.request_id.set(accepted_requests[0].request_id)
        builder = CompletionBuilder(model.name, accepted_requests, model.texts, self._include_usage(body))
        return await self.generate(request, call, model, accepted_requests, builder, bool(body.stream), names)

    async def chat_completions(self, request: Request, call: Call) -> Response:
        body, size, model = await read_body(request, ChatCompletionRequest, self.serving, call)
        accepted, reader, names = await self.accept_chat(request, model, body, size)
        builder = ChatBuilder(model.name, [accepted], model.texts, self._include_usage(body), reader)
        return await self.generate(request, call, model, [accepted], builder, bool(body.stream), names)

    async def accept_chat(self, request: Request, model: ModelContext, body: ChatCompletionRequest, size: int
                          ) -> tuple[AcceptedRequest, OutputReader | None, FieldNames]:
        """A chat request made ready for the engine: its messages rendered by the model's chat template, its
        fields checked; with how its output is read (reasoning, calls) and how its errors name its fields.
        The other chat APIs (Anthropic's Messages, OpenAI's Responses) come here as a `ChatCompletionRequest`."""
        template = self._chat_template(model)
        facts = model.facts
        conversation, tools = body.conversation(), body.tool_use(template.source)
        constraint, constraint_field = constraint_of(body, tools)
        names = chat_names(body, constraint_field or "max_reasoning_chars")  # which alone may set a grammar

        text, ids = await _off_loop(size > json_body.OFF_LOOP_BYTES, lambda: render_prompt(
            template, body, conversation, tools.tools if tools else None, facts))
        if not ids:
            raise InvalidRequest("messages", "the chat template rendered them as an empty prompt")
        start = output_start(template.source, text)
        constraint = after_reasoning(constraint, start, body.max_reasoning_chars)
        fields = {"prompt_token_ids": ids, "n": 1 if body.n is None else body.n,
                  "top_logprobs": body.top_logprobs or 0, "logprobs": bool(body.logprobs), "constraint": constraint}
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        accepted = self._accept(model, fields, body, max_tokens, None, names, request)
        logs.request_id.set(accepted.request_id)
        return accepted, output_reader(start, tools), names

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, request: Request, call: Call, model: ModelContext,
                       accepted_requests: list[AcceptedRequest], builder: BodyBuilder, stream: bool,
                       names: FieldNames) -> Response:
        """Run the accepted requests on `model`; the answer is `builder`'s body, whole or as its stream of events."""
        try:
            # the engine checks them; a response sent whole needs their events only at the end
            generation = await Generation.start(self.serving, call, model, accepted_requests, whole=not stream)
        except InvalidRequest as e:
            raise names.renamed(e) from None
        builder.timings_of = generation.timings
        if stream:
            outcome = {"code": "499"}  # until the stream ends otherwise: the client went away

            def cleanup() -> None:
                generation.close()
                call.finished(outcome["code"], outcome["code"] == "200")

            return SSEResponse(self._events(generation, builder, outcome), cleanup,
                               {"X-Request-Id": accepted_requests[0].request_id})
        try:
            async for index, events in generation.events(request.receive):
                builder.add(index, events)
        except ClientGone:
            call.finished("499", False)
            return Response(status_code=499)
        finally:
            generation.close()
        headers = {"X-Request-Id": accepted_requests[0].request_id}
        request0 = accepted_requests[0].request
        scored = call.tokens + (builder.prompt_tokens * builder.n if request0.prompt_logprobs is not None else 0)
        if isinstance(builder, ResponseBuilder) and \
                scored * (1 + (request0.top_logprobs if request0.logprobs else 0)) > LARGE_RESPONSE_ENTRIES:
            return self._ok(call, StreamingResponse(json_pieces(builder.response()), media_type="application/json",
                                                    headers=headers))
        return self._ok(call, JSONResponse(builder.response(), headers=headers))

    async def _events(self, generation: Generation, builder: BodyBuilder, outcome: dict[str, str]):
        """The SSE body. An error after the stream began is sent as the builder's error event. A client that
        goes away ends it where it is (Starlette cancels it), its outcome left at 499."""
        try:
            for chunk in builder.stream_head():
                yield chunk
            async for index, events in generation.events():
                for chunk in builder.chunks(index, events):
                    yield chunk
            for chunk in builder.stream_tail():
                yield chunk
            outcome["code"] = "200"
        except Exception as e:  # the stream has begun (200 sent): its end is an error event
            status = http_status_for(e)
            outcome["code"] = str(status.status)
            if status.is_bug:
                log.error("stream ended early: %s: %s", status.message, internal_detail(e), exc_info=e)
            else:
                log.info("stream ended early: %s %s", status.status, status.message)
            for chunk in builder.stream_error(status):
                yield chunk

    # ---- plumbing -------------------------------------------------------------------------------

    def _accept(self, model: ModelContext, fields: dict[str, Any], body: SamplingFields, max_tokens: int | None,
                default_max_new: int | None, names: FieldNames, request: Request) -> AcceptedRequest:
        """The engine request of `fields` and the body's sampling, stopping and beam search; errors named as the
        body names the fields (`names`), and the body's or the header's timeout as its deadline."""
        fields = {**fields, "request_id": request.headers.get("x-request-id", ""), "priority": body.priority or 0}
        try:
            accepted = accept(fields, body.sampling(), body.stopping(max_tokens), body.beam(), model.facts,
                              default_max_new)
        except InvalidRequest as e:
            raise names.renamed(e) from None
        timeout = body.timeout if body.timeout is not None else header_timeout(request)
        if timeout is not None:
            if not (math.isfinite(timeout) and timeout > 0):
                raise InvalidRequest("timeout", f"{timeout!r} is not a positive number of seconds")
            accepted.request.deadline = time.monotonic() + timeout
        return accepted

    def _chat_template(self, model: ModelContext) -> ChatTemplate:
        """`model`'s chat template (read once); InvalidRequest naming `messages` when it cannot chat."""
        engine = model.ready()
        if model.chat_template is None and engine.encoder_decoder:
            model.chat_template = (None, "it is an encoder-decoder, which turns a source sequence into a target, "
                                         "not a conversation into a reply")
        if model.chat_template is None:
            try:
                model.chat_template = (ChatTemplate.from_bundle(engine.config.bundle), "it has no chat template")
            except (ChatTemplateError, OSError, ValueError) as e:
                model.chat_template = (None, f"its chat template cannot be used: {e}")
        template, why = model.chat_template
        if template is None:
            raise InvalidRequest("messages", f"model {model.name!r} cannot chat: {why} (use "
                                 "/v1/completions with a prompt)")
        return template

    @staticmethod
    def _include_usage(body: SamplingFields) -> bool:
        return bool(body.stream and body.stream_options and body.stream_options.include_usage)

    def _ok(self, call: Call, response: Response) -> Response:
        call.finished("200", True)
        return response

    def _failed(self, call: Call, error: Exception,
                errors: Callable[[HttpStatus], Response] = error_response) -> Response:
        if isinstance(error, HttpError):
            status = error.status
        else:
            retry_ms = self.serving.retry_after_ms(call.model) if isinstance(error, Overloaded) else 0
            status = http_status_for(error, retry_ms)
        if status.is_bug:
            log.error("%s: %s", status.message, internal_detail(error), exc_info=error)
        elif call.admitted is None:  # refused before it reached the engine (requests that ran log in finished())
            log.info("http %s %d: %s", call.method, status.status, status.message)
        response = errors(status)
        call.finished(str(response.status_code), False)  # as the client sees it (an error shape may change it)
        return response

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        self.serving.metrics.requests.labels("http", "other", str(exc.status_code)).inc()
        path = request.url.path
        errors = anthropic_error_response if path == "/v1/messages" or path.startswith("/v1/messages/") \
            else error_response
        return errors(HttpStatus(exc.status_code, kind, message, None, tuple((exc.headers or {}).items())))


async def _off_loop(heavy: bool, work: Callable[[], T]) -> T:
    """`work()`, in a worker thread when it is heavy (a large body, many prompts) so that the event loop,
    and every other request on both fronts, does not wait for it."""
    return await asyncio.to_thread(work) if heavy else work()
