"""The request body of OpenAI's Responses API (`POST /v1/responses`), as far as this server serves it, and
its translation into the chat request every chat API is served as.

    body, size = await read_body(request, ResponsesRequest, serving)
    chat = body.chat_request()        # a ChatCompletionRequest: input items -> messages, text.format -> ...
    raise responses_error(error)      # a chat request's error, naming the field as this body spells it

The server is stateless: a request carries its whole conversation in `input`, nothing is stored
(`store` changes nothing), and `previous_response_id` or `conversation` is refused by name. `input` is
a string (one user message) or a list of items: messages (`developer` is a system message), earlier
function calls (each joins the assistant turn before it), their outputs (tool messages) and reasoning
items (the next assistant turn's `reasoning_content`). Items are checked one by one, so that an error
names the item (`input[2].call_id`). As in `openai_schema`, a field this server does not implement is
refused by name; those accepted without effect are listed in docs/api.md. Logprobs are returned when
`include` names `message.output_text.logprobs` (`top_logprobs` alternatives each); `top_logprobs` alone is
checked and, as in OpenAI's API, returns none. With `reasoning.encrypted_content` included, reasoning items
carry their text `sealed` (encoded, not encrypted: the server keeps no keys), so that a client that stores
nothing on the server sends it back in `input` and the next turn has it (`unsealed`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from service.engine.errors import InvalidRequest
from service.engine.request import MAX_TOP_LOGPROBS
from service.fronts.http.openai_schema import ChatCompletionRequest, Number
from service.fronts.http.request_body import validated

STATELESS = "this server is stateless and keeps no responses; send the whole conversation in input"
LOGPROBS = "message.output_text.logprobs"
REASONING = "reasoning.encrypted_content"
INCLUDES = (LOGPROBS, REASONING)  # what `include` can add to the output here
SEALED = "attnserve-reasoning-v1:"  # how a reasoning item's `encrypted_content` from this server begins
# a chat request's field -> the Responses request's (longest first: a name is renamed where it is whole)
CHAT_NAMES = {"response_format.json_schema.schema": "text.format.schema", "response_format": "text.format",
              "tool_choice.function.name": "tool_choice.name", "max_tokens": "max_output_tokens",
              "messages": "input", "reasoning_effort": "reasoning.effort"}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]  # the only tool this server runs: the client's own functions
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # the schema is enforced under a required or named tool_choice, strict or not


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted: the model's length is its own


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries are written: `summary` stays []


# ---- input items, each checked on its own ------------------------------------------------------------

class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an earlier output's, sent back
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[ContentPart]
    id: StrictStr | None = None  # an earlier output's, sent back
    status: StrictStr | None = None


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # a JSON object, as text
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[ContentPart]
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


def sealed(text: str) -> str:
    """A reasoning item's text as its `encrypted_content`: opaque to the client, read back by `unsealed`."""
    return SEALED + base64.urlsafe_b64encode(text.encode()).decode()


def unsealed(value: str, where: str) -> str:
    try:
        if value.startswith(SEALED):
            return base64.urlsafe_b64decode(value.removeprefix(SEALED).encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise InvalidRequest(where, "was not written by this server (it reads back only the encrypted_content of its "
                         "own reasoning items)")


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: StrictStr | None = None
    status: StrictStr | None = None
    encrypted_content: StrictStr | None = None  # `sealed` by this server


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: StrictBool | None = None  # no obfuscation padding is sent: the events are what they are


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: StrictBool | None = False
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    max_tool_calls: StrictInt | None = None  # a bound on built-in tool calls: this server runs none
    truncation: Literal["disabled", "auto"] | None = None
    # accepted and without effect here (docs/api.md)
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # the prefix cache finds shared prefixes by itself
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None  # one tier: "default"
    stream_options: StreamOptions | None = None
    # refused: they name state this server does not keep
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise InvalidRequest(name, STATELESS)
        if self.truncation == "auto":
            raise InvalidRequest("truncation", "only 'disabled' is served: an input that does not fit the context is "
                                 "refused, never cut")
        for i, name in enumerate(self.include or ()):
            if name not in INCLUDES:
                raise InvalidRequest(f"include[{i}]", f"{name!r} is not served: of what include can name, this server "
                                     f"adds {' and '.join(map(repr, INCLUDES))} (no tool results of its own)")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise InvalidRequest("max_tool_calls", f"must be at least 1, got {self.max_tool_calls}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            for name, value in (("name", fmt.name), ("schema", fmt.schema_)):
                if value is None:
                    raise InvalidRequest(f"text.format.{name}", "is required with type json_schema")

    def chat_request(self) -> ChatCompletionRequest:
        """This request as a chat request: its messages, tools, constraint and sampling. Raises the chat
        request's own refusals (`responses_error` names them as this body does)."""
        fields: dict[str, Any] = {"messages": self.messages(), "max_tokens": self.max_output_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
                                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools is not None:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_unset=True)}
                               for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            spec = fmt.model_dump(exclude={"type"}, by_alias=True, exclude_none=True)
            fields["response_format"] = {"type": fmt.type, "json_schema": spec}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        if self.included(LOGPROBS):
            fields["logprobs"], fields["top_logprobs"] = True, self.top_logprobs
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        chat = validated(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None})
        chat.refuse_unsupported()
        return chat

    def echo(self) -> dict[str, Any]:
        """The request's parameters as a Response repeats them: as sent, or their defaults; `store` is false
        whatever was sent, since nothing was stored."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice) else self.tool_choice
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": None,
                "reasoning": (self.reasoning or ReasoningConfig()).model_dump(),
                "store": False, "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True),
                                         "verbosity": (self.text.verbosity if self.text else None) or "medium"},
                "tool_choice": choice or "auto", "tools": [tool.model_dump() for tool in self.tools or []],
                "top_logprobs": self.top_logprobs, "truncation": "disabled", "user": self.user,
                "max_tool_calls": self.max_tool_calls, "prompt_cache_key": self.prompt_cache_key,
                "safety_identifier": self.safety_identifier, "service_tier": "default"}

    def included(self, name: str) -> bool:
        return name in (self.include or ())

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` as the first system message, then `input` as chat messages."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
        for i, raw in enumerate(self.input):
            item = _item(i, raw)
            if isinstance(item, ReasoningItem):
                reasoning = "".join(part.text for part in item.content or item.summary) or None
                if reasoning is None and item.encrypted_content is not None:
                    reasoning = unsealed(item.encrypted_content, f"input[{i}].encrypted_content") or None
                continue
            if isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _text(item.output)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": _arguments(item.arguments, f"input[{i}]")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)  # the calls of the turn before it
                    continue
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
            if messages[-1]["role"] == "assistant" and reasoning is not None:
                messages[-1]["reasoning_content"] = reasoning
            reasoning = None
        if not messages:
            raise InvalidRequest("input", "holds no message; give at least one, or instructions")
        return messages


def _item(index: int, raw: dict[str, Any]) -> BaseModel:
    """Item `index` of `input`, checked as its kind; errors name it (`input[2].call_id`)."""
    kind = raw.get("type", "message")
    if kind == "item_reference":
        raise InvalidRequest(f"input[{index}].type", f"'item_reference' names a stored item; {STATELESS}")
    if kind not in ITEMS:
        raise InvalidRequest(f"input[{index}].type", f"{kind!r} items are not served; this server takes "
                             f"{', '.join(ITEMS)} items")
    try:
        return validated(ITEMS[kind], raw)
    except InvalidRequest as e:
        message = str(e).removeprefix(e.field + ": ")
        raise InvalidRequest(f"input[{index}]" + ("" if e.field == "body" else f".{e.field}"), message) from None


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _arguments(arguments: str, where: str) -> str:
    """An earlier call's arguments, which the chat template reads as an object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        raise InvalidRequest(f"{where}.arguments", "is not JSON text") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}.arguments", "is not a JSON object")
    return arguments


def responses_error(error: InvalidRequest) -> InvalidRequest:
    """A chat request's error (its field and the fields its message mentions) as a Responses request spells
    them: `max_tokens` is `max_output_tokens`, `response_format` `text.format`, a tool's `function.name` its
    `name`, the messages the `input`."""
    message = str(error).removeprefix(error.field + ": ")
    field = re.sub(r"^(tools\[\d+\])\.function\.", r"\1.", error.field)
    field = "input" if field.startswith("messages") else CHAT_NAMES.get(field, field)
    for chat, own in CHAT_NAMES.items():
        if "_" in chat:
            message = re.sub(rf"(?<![\w.]){re.escape(chat)}(?![\w.])", own, message)
    return InvalidRequest(field, message)
