"""The request bodies of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as far
as this server serves them, and their translation into the chat request of the OpenAI API, so that one
conversation is rendered, checked and run the same way whichever API brings it.

    body = MessagesRequest.model_validate(data)    # extra fields refused by name, as openai_schema's
    body.refuse_unsupported()                      # what the types cannot say, named as the body spells it
    chat = body.chat()                             # the same request as a ChatCompletionRequest

The translation (docs/api.md, "The Messages API"):

    system (a string or text blocks)         a first `system` message
    text blocks                              the message's content (text parts, joined as a chat message's are)
    an assistant's tool_use blocks           its `tool_calls`, `input` as the arguments' JSON
    an assistant's thinking blocks           its `reasoning_content` (the template writes it or not);
                                             redacted_thinking blocks are dropped
    a user's tool_result blocks              `tool` messages (`tool_call_id`, and the name of the tool called),
                                             before the message's text
    tools {name, description, input_schema}  function tools {name, description, parameters}
    tool_choice auto / any / tool / none     "auto" / "required" / the named tool / "none";
                                             disable_parallel_tool_use: parallel_tool_calls false
    thinking enabled or adaptive / disabled  chat_template_kwargs enable_thinking true / false
    output_config.format (json_schema)       response_format json_schema
    stop_sequences                           stop
    max_tokens, temperature, top_p, top_k    the same fields
    a final assistant message (a prefill)    continue_final_message: the answer goes on from its text
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from service.engine.errors import InvalidRequest
from service.fronts.http.openai_schema import TOOL_NAME, ChatCompletionRequest, Number


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = None  # the prefix cache needs no marks
    citations: None = None


class ContentBlock(BaseModel):
    """A message's content block, of any of the types served: the fields its type takes are BLOCK_FIELDS[type]
    (`check`). One model for all of them, so that a wrong type is named as such (no images or documents)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: StrictStr | None = None
    id: StrictStr | None = None  # tool_use: the call's, which its tool_result names
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    tool_use_id: StrictStr | None = None  # tool_result: the call it answers
    content: list[TextBlock] | StrictStr | None = None
    is_error: StrictBool | None = None  # chat templates have no place for it: the result's content says it
    thinking: StrictStr | None = None
    signature: StrictStr | None = None
    data: StrictStr | None = None
    cache_control: dict[str, Any] | None = None
    citations: None = None

    def check(self, where: str) -> None:
        """Its type's required fields are there, and no field its type does not take."""
        required, optional = BLOCK_FIELDS[self.type]
        for name in sorted(required):
            if getattr(self, name) is None:
                raise InvalidRequest(f"{where}.{name}", f"is required in a {self.type} block")
        for name in sorted(self.model_fields_set - required - optional - {"type"}):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{where}.{name}", f"is not a field of a {self.type} block")


# a block's type -> (the fields it needs, the fields it may have)
BLOCK_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "text": (frozenset({"text"}), frozenset({"cache_control", "citations"})),
    "tool_use": (frozenset({"id", "name", "input"}), frozenset({"cache_control"})),
    "tool_result": (frozenset({"tool_use_id"}), frozenset({"content", "is_error", "cache_control"})),
    "thinking": (frozenset({"thinking"}), frozenset({"signature"})),
    "redacted_thinking": (frozenset({"data"}), frozenset()),
}


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | StrictStr  # the list first: its errors are the ones worth reporting


class CustomTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None  # server tools (web search, code execution, ...) are not served
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None  # with type "tool" only
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: StrictInt | None = None  # the reasoning counts toward max_tokens; there is no other bound


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictStr | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    """What /v1/messages/count_tokens takes: what decides the prompt /v1/messages would render, and what
    Anthropic's count_tokens takes besides (`output_config`, `cache_control`)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | StrictStr | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # count_tokens: the constraint adds no prompt tokens
    cache_control: dict[str, Any] | None = None  # the prefix cache needs no marks

    def refuse_unsupported(self) -> None:
        self._check_messages()
        self._check_tools()

    def _check_messages(self) -> None:
        for i, m in enumerate(self.messages):
            for j, block in enumerate(m.content if isinstance(m.content, list) else []):
                block.check(f"messages[{i}].content[{j}]")
                if m.role == "user" and block.type in ("tool_use", "thinking", "redacted_thinking"):
                    raise InvalidRequest(f"messages[{i}].content[{j}]", f"a {block.type} block belongs in an "
                                         "assistant message")
                if m.role == "assistant" and block.type == "tool_result":
                    raise InvalidRequest(f"messages[{i}].content[{j}]", "a tool_result block belongs in a user "
                                         "message")
        if self.messages[-1].role == "assistant":
            self._check_prefill(len(self.messages) - 1)

    def _check_prefill(self, last: int) -> None:
        """A final assistant message is text the answer continues: text alone, not ending in whitespace (as
        Anthropic's API refuses it), and neither reasoning nor an output format to begin the answer anew."""
        content = self.messages[last].content
        blocks = [TextBlock(type="text", text=content)] if isinstance(content, str) else content
        for j, block in enumerate(blocks):
            if block.type != "text":
                raise InvalidRequest(f"messages[{last}].content[{j}]", f"a final assistant message is continued "
                                     f"(a prefill) and takes text alone, not a {block.type} block")
        text = "".join(block.text for block in blocks)
        if not text or text != text.rstrip():
            raise InvalidRequest(f"messages[{last}].content", "a final assistant message (a prefill) cannot be "
                                 "empty or end with whitespace")
        if self.thinking is not None and self.thinking.type != "disabled":
            raise InvalidRequest("thinking", "a final assistant message (a prefill) is continued as the answer: "
                                 "it cannot be combined with thinking")
        if self.output_config is not None and self.output_config.format is not None:
            raise InvalidRequest("output_config.format", "constrains the whole answer, which a final assistant "
                                 "message (a prefill) has begun already")

    def _check_tools(self) -> None:
        names: dict[str, int] = {}
        for i, tool in enumerate(self.tools or []):
            if not TOOL_NAME.fullmatch(tool.name):
                raise InvalidRequest(f"tools[{i}].name", f"{tool.name!r} is not 1 to 64 letters, digits, "
                                     "underscores or dashes")
            if tool.name in names:
                raise InvalidRequest(f"tools[{i}].name", f"{tool.name!r} names tools[{names[tool.name]}] too")
            names[tool.name] = i
        choice = self.tool_choice
        if choice is None:
            return
        if choice.type == "tool" and choice.name is None:
            raise InvalidRequest("tool_choice.name", "is required with type 'tool'")
        if choice.type != "tool" and choice.name is not None:
            raise InvalidRequest("tool_choice.name", f"is for type 'tool' only, not {choice.type!r}")
        if choice.type in ("any", "tool") and not names:
            raise InvalidRequest("tool_choice", f"type {choice.type!r} needs tools")
        if choice.name is not None and choice.name not in names:
            raise InvalidRequest("tool_choice.name", f"{choice.name!r} is not among the tools ({', '.join(names)})")

    def chat(self) -> ChatCompletionRequest:
        """This request as the OpenAI API's chat request (the module docstring lists what becomes what)."""
        return ChatCompletionRequest.model_validate(self._chat_fields())

    def _chat_fields(self) -> dict[str, Any]:
        messages = [{"role": "system", "content": _parts(self.system)}] if self.system is not None else []
        called: dict[str, str] = {}  # tool_use id -> the tool's name
        for m in self.messages:
            messages.extend(_assistant(m, called) if m.role == "assistant" else _user(m, called))
        fields: dict[str, Any] = {"messages": messages}
        if self.messages[-1].role == "assistant":
            fields["add_generation_prompt"], fields["continue_final_message"] = False, True
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if self.thinking is not None:
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        output_format = self.output_config.format if self.output_config else None
        if output_format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                                "schema": output_format.schema_}}
        return fields


class MessagesRequest(CountTokensRequest):
    """What /v1/messages takes."""

    max_tokens: StrictInt
    stream: StrictBool | None = False
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    metadata: Metadata | None = None  # accepted, changes nothing
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, changes nothing: there is one tier

    def _chat_fields(self) -> dict[str, Any]:
        fields = {**super()._chat_fields(), "max_tokens": self.max_tokens, "stream": self.stream}
        sampling = {"stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k}
        fields.update({name: value for name, value in sampling.items() if value is not None})
        return fields


def _parts(content: list[TextBlock] | list[ContentBlock] | str | None) -> list[dict[str, str]] | str:
    """Text as a chat message's content: a string as it is, the text blocks of a list as text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    return [{"type": "text", "text": block.text} for block in content if block.type == "text"]


def _assistant(m: MessageParam, called: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant turn as one chat message: its text, its reasoning, its calls (remembered in `called`)."""
    if isinstance(m.content, str):
        return [{"role": "assistant", "content": m.content}]
    blocks = m.content
    message: dict[str, Any] = {"role": "assistant", "content": _parts(blocks) or None}
    thinking = [b.thinking for b in blocks if b.type == "thinking"]
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    calls = [b for b in blocks if b.type == "tool_use"]
    if calls:
        message["tool_calls"] = [{"id": b.id, "type": "function", "function": {
            "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}} for b in calls]
        called.update((b.id, b.name) for b in calls)
    return [message]


def _user(m: MessageParam, called: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn as chat messages: a `tool` message per tool result, then the text (if any besides)."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    results = [b for b in m.content if b.type == "tool_result"]
    messages = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _parts(b.content),
                 **({"name": called[b.tool_use_id]} if b.tool_use_id in called else {})} for b in results]
    text = _parts(m.content)
    if text or not results:
        messages.append({"role": "user", "content": text})
    return messages
