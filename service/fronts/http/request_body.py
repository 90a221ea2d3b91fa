"""Reading an HTTP request: its body within its size and time limits, parsed and bounded
(`json_body`), the model its `model` names resolved, the list limits that depend on that model's engine,
then validated as the endpoint's schema; and the deadline a request carries in its `X-Request-Timeout` header.

    body, size, model = await read_body(request, CompletionRequest, serving, call)   # the model loaded and held
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from service.engine.errors import InvalidRequest
from service.fronts.call import Call
from service.fronts.generation import ClientGone
from service.fronts.http import json_body
from service.fronts.http.errors import BodyTimeout, TooLarge, schema_error
from service.fronts.http.openai_schema import CompletionRequest
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext

TIMEOUT_HEADER = "x-request-timeout"


async def read_body(request: Request, schema: type[BaseModel], serving: ServingContext, call: Call
                    ) -> tuple[Any, int, ModelContext]:
    """The body as `schema`, its size and the model it names, loaded and held for `call`: 413 past the size
    limit, 408 past the body deadline, 400 for JSON or a field of the wrong type, or a list longer than its
    limit (`json_body`, `check_counts`). Checks first that the server is serving (503), then that the model is
    served (404) and serves (503)."""
    serving.admit_calls()
    default = serving.default
    hint = (f" (and at most {default.engine.most_admitted_at_once()} prompts for {default.name!r})"
            if schema is CompletionRequest and default is not None and default.engine is not None else "")
    data, size = await read_json(request, serving, hint)
    body, model = await checked(schema, data, serving, call)
    return body, size, model


async def read_json(request: Request, serving: ServingContext, hint: str = "") -> tuple[Any, int]:
    """The body parsed as JSON (`json_body`), and its size, within the size and time limits; `hint`: what a
    too-large body's error adds."""
    max_body = serving.settings.max_receive_message_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body:
        raise TooLarge(int(declared), max_body)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(serving.settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise TooLarge(size, max_body)
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("the client disconnected while sending") from None
    except TimeoutError:
        raise BodyTimeout(size, serving.settings.body_timeout_s) from None
    return await json_body.parse(b"".join(chunks), hint), size


async def checked(schema: type[BaseModel], data: Any, serving: ServingContext, call: Call
                  ) -> tuple[Any, ModelContext]:
    """`data` (a parsed body) as `schema`, and the model its `model` names (the default when it names none;
    404 naming those served when it names another; 503 when it does not serve), loaded if need be and held
    for `call`; its lists within their limits and nothing in it that the server cannot honour (the schema's
    `refuse_unsupported`)."""
    name = data.get("model") if isinstance(data, dict) else None
    model = serving.resolve(name if isinstance(name, str) else None)  # not a string: the schema says so
    await serving.take(model, call)
    check_counts(data, model)
    body = validated(schema, data)
    body.refuse_unsupported()
    return body, model


def validated(schema: type[BaseModel], data: Any) -> Any:
    """`data` (parsed JSON) as `schema`; else InvalidRequest naming the first bad field as the client spells
    it, with its value and what the field takes (`errors.schema_error`)."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise schema_error(e, schema, data) from None


def check_counts(data: Any, model: ModelContext) -> None:
    """The limits on lists whose length depends on the engine, before any item is looked at: prompts
    (what could ever be admitted at once) and chat messages (each takes at least a token)."""
    if not isinstance(data, dict):
        return
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        n = data["n"] if isinstance(data.get("n"), int) and data["n"] > 0 else 1
        engine = model.ready()
        most = engine.most_admitted_at_once(n)
        if len(prompt) > most:
            raise InvalidRequest("prompt", f"holds {len(prompt)} prompts; at most {most} can be admitted at once "
                                 f"(max_running {engine.max_running} sequences, max_waiting "
                                 f"{engine.config.max_waiting} requests, n {n})")
    if isinstance(messages, list) and model.facts is not None and len(messages) > model.facts.n_ctx:
        raise InvalidRequest("messages", f"holds {len(messages)} messages; at most {model.facts.n_ctx} fit "
                             f"the model context of {model.facts.n_ctx} tokens")


def header_timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequest("timeout", f"the {TIMEOUT_HEADER} header {value!r} is not a number of seconds") from None
