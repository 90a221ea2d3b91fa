"""The request bodies of the OpenAI API, as far as this server serves them: their fields and types.

Only types live here. Every range (temperature, top_p, n, max_tokens, the stop strings, ...) is the
engine's and is checked by `service.fronts.validation.accept`, for this front and the gRPC front
alike; the tools of a chat request are checked here (their names, `tool_choice` against them), and
`logit_bias`'s keys read as token ids. No field is ignored: a field this server does not implement,
whoever defines it, is refused by name (`extra="forbid"`, and `refuse_unsupported` for values it
cannot honour, such as `suffix`). The fields OpenAI accepts that change nothing here (`user`, ...) are
listed in docs/api.md. Messages and tools keep the keys they come with: the chat template reads them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from service.engine.errors import InvalidRequest
from service.fronts.reasoning import MAX_REASONING_CHARS
from service.fronts.tool_calls import ToolUse

Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # accepted: no obfuscation padding is added to the chunks


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of its fields."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class SamplingFields(BaseModel):
    """What both endpoints take: OpenAI's sampling fields and vLLM's extensions (top_k, min_p, ...)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, Number] | None = None  # token ids (as JSON object keys: strings) -> biases
    # vLLM's extensions
    top_k: StrictInt | None = None  # -1 or 0: no limit
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    # the server's deadline for the whole request, in seconds (or the X-Request-Timeout header)
    timeout: Number | None = None
    # structured output (service.fronts.http.structured): OpenAI's, then vLLM's; one at most
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None
    # beam search (vLLM's fields): best_of beams, the n best returned
    use_beam_search: StrictBool | None = None
    best_of: StrictInt | None = None
    length_penalty: Number | None = None
    early_stopping: StrictBool | Literal["never"] | None = None
    priority: StrictInt | None = None  # vLLM's: admission order, lower first

    def refuse_unsupported(self) -> None:
        if not self.use_beam_search and self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequest("best_of", "is supported only equal to n (every sampled completion is returned), "
                                 "or as the beam width with use_beam_search")

    def beam(self) -> dict[str, Any]:
        """The beam search values the body set, as `BeamParams`' fields: with use_beam_search, best_of beams
        (default n); the others are refused without it (`service.fronts.validation.beam_search`)."""
        values = {"length_penalty": self.length_penalty, "early_stopping": self.early_stopping}
        if self.use_beam_search:
            values["width"] = self.best_of if self.best_of is not None else (self.n or 1)
        return {name: value for name, value in values.items() if value is not None}

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling values the client set (unset ones keep the engine's defaults)."""
        values = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "seed": self.seed,
                  "top_k": 0 if self.top_k == -1 else self.top_k,
                  "logit_bias": None if self.logit_bias is None else token_biases(self.logit_bias)}
        return {name: value for name, value in values.items() if value is not None}

    def stopping(self, max_tokens: int | None) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        values = {"max_new_tokens": max_tokens, "min_new_tokens": self.min_tokens, "stop": stop,
                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos}
        return {name: value for name, value in values.items() if value is not None}


TOKEN_ID_KEY = re.compile(r"[0-9]{1,18}")  # a token id as an object key: a decimal integer


def token_biases(biases: dict[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as the keys of a JSON object, so strings) as the engine's: id -> bias.
    A key that is not a decimal integer, or names the same id as another ("05" and "5"), is refused by name;
    the ids' and biases' ranges are the engine's (`SamplingParams`, `GenerationRequest.validate`)."""
    out: dict[int, float] = {}
    for key, bias in biases.items():
        if not TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequest(f"logit_bias.{key}", "is not a token id: the keys are token ids written as "
                                 "decimal integers")
        if int(key) in out:
            raise InvalidRequest(f"logit_bias.{key}", f"names token {int(key)}, which another key names too")
        out[int(key)] = bias
    return out


Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None  # top alternatives per token; 0 = the chosen token's logprob only
    suffix: StrictStr | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise InvalidRequest("suffix", "is not supported by this server (no insertion)")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, as text or token ids: one choice group each."""
        p = self.prompt
        if not p:
            raise InvalidRequest("prompt", "is empty; give a string, a list of strings or a list of token ids")
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        if any(not prompt for prompt in p):
            raise InvalidRequest("prompt", "holds an empty prompt; every prompt needs at least one token")
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr  # a JSON object, as text


class MessageToolCall(BaseModel):
    """A call of an earlier assistant message, as OpenAI returned it."""

    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read more (name, tool_call_id, ...)
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None


TEMPLATE_FIELDS = ("messages", "tools", "add_generation_prompt", "documents")  # what render() passes itself
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept for the template, as the client sent them
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatPrompt(BaseModel):
    """What a chat prompt is rendered from (`service.fronts.http.chat_prompt`): the messages, the tools and the
    template's variables, as /v1/chat/completions and /tokenize take them."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's: the prompt ends inside the final (assistant) message
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template

    def check_prompt(self) -> dict[str, int]:
        """Refuse what cannot be rendered; returns each tool's index by its name."""
        names: dict[str, int] = {}
        for i, tool in enumerate(self.tools or []):
            name = tool.function.name
            if not TOOL_NAME.fullmatch(name):
                raise InvalidRequest(f"tools[{i}].function.name", f"{name!r} is not 1 to 64 letters, digits, "
                                     "underscores or dashes")
            if name in names:
                raise InvalidRequest(f"tools[{i}].function.name", f"{name!r} names tools[{names[name]}] too")
            names[name] = i
        for key in self.chat_template_kwargs or {}:
            if key in TEMPLATE_FIELDS:
                raise InvalidRequest(f"chat_template_kwargs.{key}", f"is set by the request's own fields "
                                     f"({', '.join(TEMPLATE_FIELDS)}); remove it")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message", "needs add_generation_prompt: false (the prompt goes on "
                                 "with the final message, not a new one)")
        return names

    def template_variables(self) -> dict[str, Any]:
        """The chat template's variables besides messages, tools and add_generation_prompt."""
        return dict(self.chat_template_kwargs or {})

    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools as sent, for the template."""
        return [tool.model_dump(exclude_unset=True) for tool in self.tools or []]

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them: plain dicts, text parts joined, None values dropped
        (as transformers' apply_chat_template passes them), the arguments of earlier tool calls as objects
        (transformers' templates write them with `tojson`; OpenAI sends them as JSON text)."""
        out = []
        for i, m in enumerate(self.messages):
            message = {k: v for k, v in m.model_dump(exclude={"tool_calls"}).items() if v is not None}
            if m.tool_calls is not None:
                message["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                         for j, call in enumerate(m.tool_calls)]
            if isinstance(m.content, list):
                parts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise InvalidRequest(f"messages[{i}].content[{j}]",
                                             f"only text parts are supported; got type {part.type!r}")
                    parts.append(part.text)
                message["content"] = "".join(parts)
            out.append(message)
        return out


class ChatCompletionRequest(ChatPrompt, SamplingFields):
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_reasoning_chars: StrictInt | None = None  # the reasoning section's bound, by the grammar (attnserve's)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # OpenAI's, accepted and without effect here (docs/api.md)
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        names = self.check_prompt()
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        if self.reasoning_effort is not None and thinking is not None and \
                thinking is not (self.reasoning_effort != "none"):
            raise InvalidRequest("reasoning_effort", f"{self.reasoning_effort!r} and chat_template_kwargs."
                                 f"enable_thinking {thinking!r} disagree; send one of them")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest("tool_choice.function.name", f"{choice.function.name!r} is not among the tools "
                                 f"({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise InvalidRequest("tool_choice", "'required' needs tools")
        if self.store:
            raise InvalidRequest("store", "this server keeps no completions; leave it false or unset")
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequest("modalities", "only [\"text\"] is served")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        if self.max_reasoning_chars is not None and not 1 <= self.max_reasoning_chars <= MAX_REASONING_CHARS:
            raise InvalidRequest("max_reasoning_chars", f"{self.max_reasoning_chars} is outside "
                                 f"[1, {MAX_REASONING_CHARS}]")

    def template_variables(self) -> dict[str, Any]:
        """With `reasoning_effort`: `enable_thinking` false for "none", else true (Qwen3's switch, which templates
        without it ignore), and the effort itself as `reasoning_effort` (gpt-oss's templates read it)."""
        variables = super().template_variables()
        if self.reasoning_effort is not None:
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables

    def tool_use(self, template_source: str) -> ToolUse | None:
        """What the tools ask of this generation; None without tools or with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return ToolUse.of(self.tool_specs(), template_source, self.parallel_tool_calls is not False,
                          self.tool_choice == "required", name)


def _template_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    """An earlier call as templates read it: its arguments a dict rather than JSON text."""
    dumped = call.model_dump(exclude_unset=True)
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        raise InvalidRequest(f"{where}.function.arguments", "is not JSON text") from None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.function.arguments", "is not a JSON object")
    return {**dumped, "function": {**dumped["function"], "arguments": arguments}}
