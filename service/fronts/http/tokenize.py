"""vLLM's tokenizer endpoints on the HTTP front: text or a chat to token ids, and token ids back to text.

    POST /tokenize     {"prompt": str, "add_special_tokens": true}                     -> the prompt's ids
                       {"messages": [...], "add_generation_prompt", "continue_final_message",
                        "add_special_tokens": false, "tools", "chat_template_kwargs"}  -> the chat prompt's ids
                       either with "model" and "return_token_strs"
                       -> {"count", "max_model_len", "tokens", "token_strs" (when asked for)}
    POST /detokenize   {"tokens": [...], "model"}  -> {"prompt": str}

A chat is rendered and tokenized as /v1/chat/completions renders and tokenizes it (`chat_prompt`), so its
`count` is that request's `usage.prompt_tokens`. Bodies are read, bounded and refused as every other body of
this front (`request_body`), in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.engine.errors import InvalidRequest
from service.fronts.call import Call
from service.fronts.http import json_body
from service.fronts.http.chat_prompt import render_prompt
from service.fronts.http.openai_schema import ChatPrompt
from service.fronts.http.request_body import checked, read_json
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext
from service.fronts.validation import check_text_fits
from service.runtime.chat_template import ChatTemplate


class TokenizePrompt(BaseModel):
    """/tokenize with a text."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # as the tokenizer adds them to a completion's prompt (Llama's BOS)
    return_token_strs: StrictBool = False

    def refuse_unsupported(self) -> None:
        pass


class TokenizeChat(ChatPrompt):
    """/tokenize with a chat, rendered as /v1/chat/completions renders it."""

    model: StrictStr | None = None
    add_special_tokens: StrictBool = False  # the template writes any BOS itself
    return_token_strs: StrictBool = False

    def refuse_unsupported(self) -> None:
        self.check_prompt()


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]

    def refuse_unsupported(self) -> None:
        pass


# the fields that go with messages alone, besides messages
CHAT_ONLY = tuple(name for name in TokenizeChat.model_fields if name not in {*TokenizePrompt.model_fields, "messages"})


def tokenize_schema(data: Any) -> type[TokenizePrompt] | type[TokenizeChat]:
    """Which /tokenize body `data` is: a chat when it has `messages`, else a text."""
    if not isinstance(data, dict):
        return TokenizePrompt
    if "messages" not in data:
        for name in CHAT_ONLY:
            if name in data:
                raise InvalidRequest(name, "goes with messages (a chat), not with prompt (a text)")
        return TokenizePrompt
    if "prompt" in data:
        raise InvalidRequest("prompt", "give either prompt (a text) or messages (a chat), not both")
    return TokenizeChat


class Tokenization:
    """The two endpoints, on the front's serving context and the model's chat template (`chat_template(model)`,
    which raises InvalidRequest naming `messages` for a model that cannot chat). The body's `model` picks the
    model, as on the generation endpoints."""

    def __init__(self, serving: ServingContext, chat_template: Callable[[ModelContext], ChatTemplate]):
        self.serving = serving
        self.chat_template = chat_template

    async def tokenize(self, request: Request, call: Call) -> Response:
        self.serving.ready()  # a draining server still tokenizes, as gRPC's Tokenize does
        data, size = await read_json(request, self.serving)
        body, model = await checked(tokenize_schema(data), data, self.serving, call)
        engine = model.ready()
        facts = model.facts
        template = self.chat_template(model) if isinstance(body, TokenizeChat) else None

        def ids() -> list[int]:
            if template is None:
                check_text_fits("prompt", body.prompt, facts)
                return facts.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            return render_prompt(template, body, body.conversation(), body.tool_specs() or None, facts,
                                 body.add_special_tokens)[1]

        tokens = await asyncio.to_thread(ids) if size > json_body.OFF_LOOP_BYTES else ids()  # large: off the loop
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.context,
                                  "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = [facts.tokenizer.hf.id_to_token(t) for t in tokens]
        call.finished("200", True)
        return JSONResponse(answer)

    async def detokenize(self, request: Request, call: Call) -> Response:
        self.serving.ready()
        data, size = await read_json(request, self.serving)
        body, model = await checked(Detokenize, data, self.serving, call)
        tokenizer = model.facts.tokenizer
        for i, token in enumerate(body.tokens):
            if not 0 <= token < tokenizer.vocab_size:
                raise InvalidRequest(f"tokens[{i}]", f"{token} is outside [0, {tokenizer.vocab_size - 1}] (the "
                                     "tokenizer's vocabulary)")
        heavy = size > json_body.OFF_LOOP_BYTES
        text = await asyncio.to_thread(tokenizer.decode, body.tokens) if heavy else tokenizer.decode(body.tokens)
        call.finished("200", True)
        return JSONResponse({"prompt": text})
