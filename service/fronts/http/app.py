"""The HTTP front: OpenAI's API on the engine, as a Starlette application.

    POST /v1/completions        prompt: a string, a list of strings, a list of token ids (or of lists)
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models             the served model, under its bundle name
    GET  /health                200 while serving, 503 while loading or draining (no token needed)

Requests are checked by the rules every front shares (`service.fronts.validation`); a bad field is a
400 whose `param` names it as OpenAI's API does (`max_tokens`, not the engine's
`stopping.max_new_tokens`). Every error has OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, with the status of `service.fronts.status`. Nothing a client sends gives a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service import logs
from service.engine.errors import EngineError, InvalidRequest, Overloaded
from service.fronts.auth import REFUSAL, BearerAuth
from service.fronts.call import Call
from service.fronts.front_state import FrontState
from service.fronts.generation import ClientGone, Generation
from service.fronts.http import json_body
from service.fronts.http.openai_responses import (
    DONE,
    ChatBuilder,
    CompletionBuilder,
    ResponseBuilder,
    json_pieces,
    sse,
)
from service.fronts.http.openai_schema import ChatCompletionRequest, CompletionRequest, SamplingFields
from service.fronts.status import HttpStatus, http_status_for
from service.fronts.validation import AcceptedRequest, accept, usable_prompt_ids
from service.runtime.chat_template import ChatTemplate, ChatTemplateError

log = logging.getLogger("attnserve.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the engine's
TIMEOUT_HEADER = "x-request-timeout"
OPEN_PATHS = frozenset({"/health"})
ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
               429: "rate_limit_exceeded", 503: "service_unavailable", 408: "timeout"}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
# the engine's field names -> the OpenAI request's
OPENAI_NAMES = {"prompt_token_ids": "prompt", "stopping.max_new_tokens": "max_tokens",
                "stopping.min_new_tokens": "min_tokens", "stopping.stop": "stop",
                "stopping.stop_token_ids": "stop_token_ids", "stopping.ignore_eos": "ignore_eos"}
LARGE_RESPONSE_ENTRIES = 16384  # tokens and logprob alternatives past which a response is encoded a choice at a time
OFF_LOOP_PROMPTS = 8  # a completions request with more prompts is checked and tokenized in a worker thread
T = TypeVar("T")
TYPE_TAG = re.compile(r"[\[\](),]|^(str|int|float|bool|none|dict)$|^[A-Z]")  # pydantic's union member names


def error_body(status: HttpStatus) -> dict[str, Any]:
    return {"error": {"message": status.message, "type": status.type, "param": status.param,
                      "code": ERROR_CODES.get(status.status)}}


def error_response(status: HttpStatus) -> JSONResponse:
    return JSONResponse(error_body(status), status_code=status.status, headers=dict(status.headers))


def openai_param(field: str, renames: dict[str, str]) -> str:
    """An engine field path (`stopping.stop[2]`, `sampling.temperature`) as the request's field name."""
    base = re.sub(r"\[\d+\]$", "", field)
    if base in renames:
        return renames[base]
    if base in OPENAI_NAMES:
        return OPENAI_NAMES[base]
    return base.removeprefix("sampling.")


def renamed(error: InvalidRequest, renames: dict[str, str]) -> InvalidRequest:
    """The error as the HTTP client sees it: the field, and the engine's names in the message, OpenAI's."""
    param = openai_param(error.field, renames)
    message = str(error).removeprefix(error.field + ": ")
    for engine_name in ("max_new_tokens", "min_new_tokens"):
        message = message.replace(engine_name, openai_param("stopping." + engine_name, renames))
    return InvalidRequest(param, message)


def schema_error(error: ValidationError) -> InvalidRequest:
    """pydantic's first complaint about a body, naming the field as the request spells it."""
    err = error.errors()[0]
    path = ""
    for part in err["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not TYPE_TAG.search(part):
            path += ("." if path else "") + part
    if not path:
        return InvalidRequest("body", "must be a JSON object")
    got = json.dumps(err.get("input"), ensure_ascii=False, default=str)
    got = got if len(got) <= 80 else got[:77] + "..."
    message = err["msg"] if err["type"] != "missing" else "is required"
    return InvalidRequest(path, f"{message}" + (f"; got {got}" if err["type"] != "missing" else ""))


class SSEResponse(StreamingResponse):
    """A server-sent-event stream whose `cleanup` runs however the response ends, even before it starts."""

    def __init__(self, content, cleanup, headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


class BearerGuard:
    """ASGI middleware: with a token set, every path but OPEN_PATHS needs `Authorization: Bearer <token>`."""

    def __init__(self, app, token: str | None, state: FrontState):
        self.app = app
        self.auth = BearerAuth(token) if token else None
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if self.auth is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            value = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.auth.authorized(value):
                path = scope["path"] if scope["path"] in ROUTES else "other"  # no label per random path
                self.state.metrics.requests.labels("http", path, "401").inc()
                response = error_response(HttpStatus(401, "authentication_error", REFUSAL))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HttpFront:
    def __init__(self, state: FrontState, token: str | None = None):
        self.state = state
        self.max_body = state.settings.max_receive_message_bytes
        self._template: tuple[ChatTemplate | None, str] | None = None  # (template, why there is none)
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})
        self.app = BearerGuard(app, token, state)

    # ---- endpoints ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        s = self.state
        status = "serving" if s.serving else "loading" if s.engine is None else "draining"
        return JSONResponse({"status": status}, status_code=200 if s.serving else 503)

    async def models(self, request: Request) -> Response:
        call = Call(self.state, "http", "/v1/models")
        try:
            return self._ok(call, JSONResponse({"object": "list", "data": [self._model_card()]}))
        except Exception as e:
            return self._failed(call, e)

    async def model(self, request: Request) -> Response:
        call = Call(self.state, "http", "/v1/models/{model}")
        try:
            self._check_model(request.path_params["model"])
            return self._ok(call, JSONResponse(self._model_card()))
        except Exception as e:
            return self._failed(call, e)

    async def completions(self, request: Request) -> Response:
        call = Call(self.state, "http", "/v1/completions")
        try:
            body, size = await self._read(request, CompletionRequest)
            if body.echo and body.logprobs is not None:
                raise InvalidRequest("echo", "echo with logprobs needs the prompt's logprobs, which this server "
                                     "does not compute; ask for one or the other")
            facts = self.state.model
            renames = {"top_logprobs": "logprobs"}
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
                              "echo": bool(body.echo)}
                    accepted_requests.append(self._accept(fields, body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                                          facts, renames, request))
                return accepted_requests

            heavy = size > json_body.OFF_LOOP_BYTES or len(prompts) > OFF_LOOP_PROMPTS
            accepted_requests = await _off_loop(heavy, accept_all)
            logs.request_id.set(accepted_requests[0].request_id)
            builder = CompletionBuilder(self._served_name(), accepted_requests, self.state.texts,
                                        self._include_usage(body))
            return await self._generate(request, call, accepted_requests, builder, bool(body.stream), renames)
        except Exception as e:
            return self._failed(call, e)

    async def chat_completions(self, request: Request) -> Response:
        call = Call(self.state, "http", "/v1/chat/completions")
        try:
            body, size = await self._read(request, ChatCompletionRequest)
            template = self._chat_template()
            facts = self.state.model
            conversation = body.conversation()

            def render() -> list[int]:
                try:
                    text = template.render(conversation, add_generation_prompt=body.add_generation_prompt)
                except ChatTemplateError as e:
                    raise InvalidRequest("messages", f"the model's chat template refused them: {e}") from None
                if facts.max_prompt_chars is not None and len(text) > facts.max_prompt_chars:
                    raise InvalidRequest("messages", f"{len(text)} characters cannot fit the model context of "
                                         f"{facts.n_ctx} tokens")
                return facts.tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS itself

            ids = await _off_loop(size > json_body.OFF_LOOP_BYTES, render)
            if not ids:
                raise InvalidRequest("messages", "the chat template rendered them as an empty prompt")
            fields = {"prompt_token_ids": ids, "n": 1 if body.n is None else body.n,
                      "top_logprobs": body.top_logprobs or 0,
                      "logprobs": bool(body.logprobs)}
            renames = {"prompt": "messages",
                       "stopping.max_new_tokens": "max_completion_tokens" if body.max_completion_tokens is not None
                       and body.max_tokens is None else "max_tokens"}
            max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
            accepted = self._accept(fields, body, max_tokens, None, facts, renames, request)
            logs.request_id.set(accepted.request_id)
            builder = ChatBuilder(self._served_name(), [accepted], self.state.texts, self._include_usage(body))
            return await self._generate(request, call, [accepted], builder, bool(body.stream), renames)
        except Exception as e:
            return self._failed(call, e)

    # ---- generation -----------------------------------------------------------------------------

    async def _generate(self, request: Request, call: Call, accepted_requests: list[AcceptedRequest],
                        builder: ResponseBuilder, stream: bool, renames: dict[str, str]) -> Response:
        try:
            generation = Generation(self.state, call, accepted_requests)  # the engine's own checks run here
        except InvalidRequest as e:
            raise renamed(e, renames) from None
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
        builder.cached_tokens = generation.cached_prompt_tokens
        headers = {"X-Request-Id": accepted_requests[0].request_id}
        request0 = accepted_requests[0].request
        if call.tokens * (1 + (request0.top_logprobs if request0.logprobs else 0)) > LARGE_RESPONSE_ENTRIES:
            return self._ok(call, StreamingResponse(json_pieces(builder.response()), media_type="application/json",
                                                    headers=headers))
        return self._ok(call, JSONResponse(builder.response(), headers=headers))

    async def _events(self, generation: Generation, builder: ResponseBuilder, outcome: dict[str, str]):
        """The SSE body. An error after the stream began is sent as an `error` event, then [DONE]. A client
        that goes away ends it where it is (Starlette cancels it), its outcome left at 499."""
        try:
            if isinstance(builder, ChatBuilder):
                for chunk in builder.role_chunks():
                    yield chunk
            async for index, events in generation.events():
                for chunk in builder.chunks(index, events):
                    yield chunk
            if builder.include_usage:
                builder.cached_tokens = generation.cached_prompt_tokens
                yield builder.usage_chunk()
            outcome["code"] = "200"
        except EngineError as e:
            status = http_status_for(e)
            outcome["code"] = str(status.status)
            log.info("stream ended early: %s %s", status.status, status.message)
            yield sse(error_body(status))
        yield DONE

    # ---- plumbing -------------------------------------------------------------------------------

    async def _read(self, request: Request, schema: type[BaseModel]):
        """The body as `schema`, and its size: 413 past the size limit, 408 past the body deadline, 400 for
        JSON or a field of the wrong type, or a list longer than its limit (`json_body`, `_check_counts`).
        Checks first that the server is serving (503) and the model is this one (404)."""
        self.state.admit()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise _TooLarge(int(declared), self.max_body)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.state.settings.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise _TooLarge(size, self.max_body)
                    chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone("the client disconnected while sending") from None
        except TimeoutError:
            raise _BodyTimeout(size, self.state.settings.body_timeout_s) from None
        hint = (f" (and at most {self.state.ready().most_admitted_at_once()} prompts)" if schema is CompletionRequest
                else "")
        data = await json_body.parse(b"".join(chunks), hint)
        self._check_counts(data)
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise schema_error(e) from None
        self._check_model(body.model)
        body.refuse_unsupported()
        return body, size

    def _check_counts(self, data: Any) -> None:
        """The limits on lists whose length depends on the engine, before any item is looked at: prompts
        (what could ever be admitted at once) and chat messages (each takes at least a token)."""
        if not isinstance(data, dict):
            return
        prompt, messages = data.get("prompt"), data.get("messages")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            n = data["n"] if isinstance(data.get("n"), int) and data["n"] > 0 else 1
            engine = self.state.ready()
            most = engine.most_admitted_at_once(n)
            if len(prompt) > most:
                raise InvalidRequest("prompt", f"holds {len(prompt)} prompts; at most {most} can be admitted at once "
                                     f"(max_running {engine.max_running} sequences, max_waiting "
                                     f"{engine.config.max_waiting} requests, n {n})")
        if isinstance(messages, list) and self.state.model is not None and len(messages) > self.state.model.n_ctx:
            raise InvalidRequest("messages", f"holds {len(messages)} messages; at most {self.state.model.n_ctx} fit "
                                 f"the model context of {self.state.model.n_ctx} tokens")

    def _accept(self, fields: dict[str, Any], body: SamplingFields, max_tokens: int | None,
                default_max_new: int | None, facts, renames: dict[str, str], request: Request) -> AcceptedRequest:
        """The engine request of `fields` and the body's sampling and stopping; errors named as the body names
        them (`renames`), and the body's or the header's timeout as its deadline."""
        fields = {**fields, "request_id": request.headers.get("x-request-id", "")}
        try:
            accepted = accept(fields, body.sampling(), body.stopping(max_tokens), facts, default_max_new)
        except InvalidRequest as e:
            raise renamed(e, renames) from None
        timeout = body.timeout if body.timeout is not None else _header_timeout(request)
        if timeout is not None:
            if not (math.isfinite(timeout) and timeout > 0):
                raise InvalidRequest("timeout", f"{timeout!r} is not a positive number of seconds")
            accepted.request.deadline = time.monotonic() + timeout
        return accepted

    def _check_model(self, name: str | None) -> None:
        served = self._served_name()
        if name and name != served:
            raise _UnknownModel(name, served)

    def _served_name(self) -> str:
        return self.state.ready().model.name

    def _model_card(self) -> dict[str, Any]:
        engine = self.state.ready()
        return {"id": engine.model.name, "object": "model", "created": int(time.time() - (time.monotonic() -
                self.state.started)), "owned_by": "attnserve", "max_model_len": engine.context}

    def _chat_template(self) -> ChatTemplate:
        if self._template is None and self.state.ready().encoder_decoder:
            self._template = (None, "it is an encoder-decoder, which turns a source sequence into a target, "
                                    "not a conversation into a reply")
        if self._template is None:
            bundle = self.state.ready().config.bundle
            try:
                self._template = (ChatTemplate.from_bundle(bundle), "it has no chat template")
            except (ChatTemplateError, OSError, ValueError) as e:
                self._template = (None, f"its chat template cannot be used: {e}")
        template, why = self._template
        if template is None:
            raise InvalidRequest("messages", f"model {self._served_name()!r} cannot chat: {why} (use "
                                 "/v1/completions with a prompt)")
        return template

    @staticmethod
    def _include_usage(body: SamplingFields) -> bool:
        return bool(body.stream and body.stream_options and body.stream_options.include_usage)

    def _ok(self, call: Call, response: Response) -> Response:
        call.finished("200", True)
        return response

    def _failed(self, call: Call, error: Exception) -> Response:
        if isinstance(error, _HttpError):
            status = error.status
        else:
            retry_ms = self.state.retry_after_ms() if isinstance(error, Overloaded) else 0
            status = http_status_for(error, retry_ms)
        if status.is_bug:
            log.error("%s", status.message, exc_info=error)
        elif call.admitted is None:  # refused before it reached the engine (requests that ran log in finished())
            log.info("http %s %d: %s", call.method, status.status, status.message)
        call.finished(str(status.status), False)
        return error_response(status)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        self.state.metrics.requests.labels("http", "other", str(exc.status_code)).inc()
        return error_response(HttpStatus(exc.status_code, kind, message, None, tuple((exc.headers or {}).items())))


class _HttpError(Exception):
    status: HttpStatus


class _TooLarge(_HttpError):
    def __init__(self, size: int, limit: int):
        super().__init__()
        self.status = HttpStatus(413, "invalid_request_error", f"the body is {size} bytes or more; the limit is "
                                 f"{limit} bytes (max_receive_message_bytes)", "body")


class _BodyTimeout(_HttpError):
    def __init__(self, size: int, limit_s: float):
        super().__init__()
        self.status = HttpStatus(408, "invalid_request_error", f"the body did not arrive within {limit_s:g} s of its "
                                 f"headers ({size} bytes did; body_timeout_s)", "body", (("Connection", "close"),))


class _UnknownModel(_HttpError):
    def __init__(self, name: str, served: str):
        super().__init__()
        self.status = HttpStatus(404, "invalid_request_error", f"the model {name!r} does not exist; this server "
                                 f"serves {served!r}", "model")


async def _off_loop(heavy: bool, work: Callable[[], T]) -> T:
    """`work()`, in a worker thread when it is heavy (a large body, many prompts) so that the event loop,
    and every other request on both fronts, does not wait for it."""
    return await asyncio.to_thread(work) if heavy else work()


def _header_timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequest("timeout", f"the {TIMEOUT_HEADER} header {value!r} is not a number of seconds") from None

