"""Reading an HTTP request: its body within its size and time limits, parsed and bounded
(`json_body`), the list limits that depend on the engine, then validated as the endpoint's schema;
and the deadline a request carries in its `X-Request-Timeout` header.

    body, size = await read_body(request, CompletionRequest, serving)
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from service.engine.errors import InvalidRequest
from service.fronts.generation import ClientGone
from service.fronts.http import json_body
from service.fronts.http.errors import BodyTimeout, TooLarge, UnknownModel, schema_error
from service.fronts.http.openai_schema import CompletionRequest
from service.fronts.serving_context import ServingContext

TIMEOUT_HEADER = "x-request-timeout"


async def read_body(request: Request, schema: type[BaseModel], serving: ServingContext):
    """The body as `schema`, and its size: 413 past the size limit, 408 past the body deadline, 400 for
    JSON or a field of the wrong type, or a list longer than its limit (`json_body`, `check_counts`).
    Checks first that the server is serving (503) and the model is this one (404)."""
    serving.admit()
    hint = (f" (and at most {serving.ready().most_admitted_at_once()} prompts)" if schema is CompletionRequest
            else "")
    data, size = await read_json(request, serving, hint)
    return checked(schema, data, serving), size


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


def checked(schema: type[BaseModel], data: Any, serving: ServingContext) -> Any:
    """`data` (a parsed body) as `schema`, its lists within their limits, its model this one (404) and nothing
    in it that the server cannot honour (the schema's `refuse_unsupported`)."""
    check_counts(data, serving)
    body = validated(schema, data)
    check_model(body.model, serving)
    body.refuse_unsupported()
    return body


def validated(schema: type[BaseModel], data: Any) -> Any:
    """`data` (parsed JSON) as `schema`; else InvalidRequest naming the first bad field as the client spells
    it, with its value and what the field takes (`errors.schema_error`)."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise schema_error(e, schema, data) from None


def check_counts(data: Any, serving: ServingContext) -> None:
    """The limits on lists whose length depends on the engine, before any item is looked at: prompts
    (what could ever be admitted at once) and chat messages (each takes at least a token)."""
    if not isinstance(data, dict):
        return
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        n = data["n"] if isinstance(data.get("n"), int) and data["n"] > 0 else 1
        engine = serving.ready()
        most = engine.most_admitted_at_once(n)
        if len(prompt) > most:
            raise InvalidRequest("prompt", f"holds {len(prompt)} prompts; at most {most} can be admitted at once "
                                 f"(max_running {engine.max_running} sequences, max_waiting "
                                 f"{engine.config.max_waiting} requests, n {n})")
    if isinstance(messages, list) and serving.model is not None and len(messages) > serving.model.n_ctx:
        raise InvalidRequest("messages", f"holds {len(messages)} messages; at most {serving.model.n_ctx} fit "
                             f"the model context of {serving.model.n_ctx} tokens")


def check_model(name: str | None, serving: ServingContext) -> None:
    served = serving.served_name()
    if name and name != served:
        raise UnknownModel(name, served)


def header_timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequest("timeout", f"the {TIMEOUT_HEADER} header {value!r} is not a number of seconds") from None
