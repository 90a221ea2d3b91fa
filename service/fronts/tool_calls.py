"""Tool calls in a chat model's output, for any front: the format a model writes them in, the parse of
its text into calls and content (whole or as it streams), and the grammar that makes a model call one.

    fmt = template_format(template.source)              # "hermes" or "llama3_json"
    parser = ToolCallParser(fmt, {"get_weather", ...})  # the names of the request's tools
    message = parser.parse(text)                        # ParsedMessage(content, calls)
    stream = parser.stream()                            # the same, piece by piece:
    piece = stream.feed(delta) ... stream.finish()      # ParsedMessage per delta; the pieces add up to parse()
    lark = call_grammar(tools, fmt, parallel, name)     # llguidance Lark text for `required` or a named tool
    use = ToolUse.of(tools, template.source, parallel, required, name)   # all of it for one request

The formats, as the families write them:

    hermes       (Hermes, Qwen2.5, SmolLM3) any text, then one or more blocks
                 <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    llama3_json  (Llama 3.1-3.3) the whole output is {"name": "get_weather", "parameters": {...}}
                 ("arguments" is read too), possibly after <|python_tag|>; several calls separated by ";"

`template_format` picks the format from the chat template's text: `<tool_call>` in it means hermes;
else `<|python_tag|>`, `ipython` or `"parameters"` means llama3_json; else hermes, whose tags cannot
be mistaken for ordinary text. A hermes block is a call when its JSON is an object naming one of the
request's tools with an object of arguments; any other block stays text. A llama3_json output is
calls only when every call in it is such a call; otherwise all of it is text. Text beside calls is the
message's content as written, but for whitespace alone between, before or after calls; a message
with no content text has `content` None.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3_json"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_HINTS = re.compile(r"<\|python_tag\|>|ipython|[\"']parameters[\"']")
# the JSON layout of a constrained call's arguments: the one json.dumps and templates' tojson write
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def template_format(source: str) -> ToolFormat:
    """The tool-call format a chat template teaches its model (see the module docstring)."""
    if HERMES_OPEN in source:
        return "hermes"
    if LLAMA3_HINTS.search(source):
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    name: str  # a tool of the request
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """A model's message, or a piece of one: its text and its calls."""

    content: str | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: ParsedMessage) -> None:
        if other.content:
            self.content = (self.content or "") + other.content
        self.calls.extend(other.calls)


class ToolCallParser:
    """Reads one format's calls to a request's tools out of a model's output."""

    def __init__(self, fmt: ToolFormat, tool_names: set[str]):
        self.format = fmt
        self.tool_names = frozenset(tool_names)

    def call(self, value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
        """`value` as a call: an object naming one of the tools, with an object of arguments (or none)."""
        if not (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] in self.tool_names):
            return None
        arguments = next((value[k] for k in arguments_keys if k in value), {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def stream(self) -> HermesStream | Llama3Stream:
        return HermesStream(self) if self.format == "hermes" else Llama3Stream(self)

    def parse(self, text: str) -> ParsedMessage:
        stream = self.stream()
        message = stream.feed(text)
        message.extend(stream.finish())
        return message


class HermesStream:
    """Text is sent as it comes, but for what may begin a `<tool_call>` block; a block is held until it
    closes, then sent as a call or, if it is none, as text. Whitespace alone between calls, or before or
    after them, is dropped (held until text or a call follows)."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.held = ""  # text not yet sent
        self.scan = 0  # where in `held` a block may still begin (before it: text known to be plain)
        self.has_text = False  # the text since the last call (or the start) is more than whitespace
        self.called = False

    def feed(self, text: str) -> ParsedMessage:
        self.held += text
        return self._drain(final=False)

    def finish(self) -> ParsedMessage:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ParsedMessage:
        out = ParsedMessage()
        while True:
            start = self.held.find(HERMES_OPEN, self.scan)
            end = self.held.find(HERMES_CLOSE, start + len(HERMES_OPEN)) if start >= 0 else -1
            if final and end < 0:  # the rest is text, but whitespace alone after a call
                if self.has_text or self.held.strip() or not self.called:
                    self._send(out, len(self.held), final)
                self.held = ""
                return out
            if start < 0:  # hold a suffix that may begin a block
                pending = self.held[self.scan:]
                partial = next((n for n in range(min(len(pending), len(HERMES_OPEN) - 1), 0, -1)
                                if HERMES_OPEN.startswith(pending[-n:])), 0)
                self._send(out, len(self.held) - partial)
                return out
            self._send(out, start)
            if end < 0:
                return out
            start = self.held.find(HERMES_OPEN, self.scan)
            end = self.held.find(HERMES_CLOSE, start + len(HERMES_OPEN))
            call = self._block(self.held[start + len(HERMES_OPEN):end])
            if call is None:  # not a call: the block is text
                self.scan = end + len(HERMES_CLOSE)
                continue
            self.held = self.held[end + len(HERMES_CLOSE):]  # whitespace alone before the call is dropped
            self.scan, self.has_text, self.called = 0, False, True
            out.calls.append(call)

    def _send(self, out: ParsedMessage, upto: int, final: bool = False) -> None:
        """Send `held[:upto]` as content, unless it is whitespace alone that a call may yet follow."""
        piece = self.held[:upto]
        if not (piece.strip() or self.has_text or final):
            return
        self.held, self.scan = self.held[upto:], max(0, self.scan - upto)
        self.has_text = self.has_text or bool(piece.strip())
        if piece:
            out.extend(ParsedMessage(piece))

    def _block(self, inner: str) -> ToolCall | None:
        try:
            value = json.loads(inner)
        except ValueError:
            return None
        return self.parser.call(value, ("arguments", "parameters"))


class Llama3Stream:
    """An output that begins (past whitespace) with `{` or `<|python_tag|>` is held to its end and sent
    as calls or as text; any other is text, sent as it comes."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.held = ""
        self.mode: Literal["undecided", "text", "held"] = "undecided"

    def feed(self, text: str) -> ParsedMessage:
        self.held += text
        if self.mode == "undecided":
            start = self.held.lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self.mode = "held"
            elif start and not PYTHON_TAG.startswith(start):
                self.mode = "text"
        if self.mode != "text":
            return ParsedMessage()
        piece, self.held = self.held, ""
        return ParsedMessage(piece or None)

    def finish(self) -> ParsedMessage:
        text, self.held = self.held, ""
        calls = self._calls(text) if self.mode == "held" else None
        return ParsedMessage(calls=calls) if calls else ParsedMessage(text or None)

    def _calls(self, text: str) -> list[ToolCall] | None:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except ValueError:
                return None
            call = self.parser.call(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            at = len(body) - len(rest.removeprefix(";").lstrip())
        return calls or None


def closed(schema: Any) -> Any:
    """`schema` with every object that does not say otherwise closed (`additionalProperties: false`): a
    call's arguments are the parameters its function declares, which is what a client can dispatch."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in SUBSCHEMAS else v for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {name: closed(s) for name, s in out["properties"].items()}
    if "$defs" in out:
        out["$defs"] = {name: closed(s) for name, s in out["$defs"].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")


def call_grammar(tools: list[dict[str, Any]], fmt: ToolFormat, parallel: bool, name: str | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of a message that is only calls in `fmt`: one call to the
    tool `name`, or calls to any of `tools`: one, or with `parallel` one or more (hermes only: Llama 3
    templates take one call per message). Each call's arguments follow its function's `parameters` schema (any object
    when it has none), laid out as `json.dumps` writes JSON."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = []
    for i, function in enumerate(functions):
        schema = closed(function.get("parameters") or {"type": "object"})
        given = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**JSON_LAYOUT, **given} if isinstance(given, dict) else JSON_LAYOUT}
        quoted = json.dumps(function["name"])
        if fmt == "hermes":
            head, tail = HERMES_OPEN + '\n{"name": ' + quoted + ', "arguments": ', "}\n" + HERMES_CLOSE
        else:
            head, tail = '{"name": ' + quoted + ', "parameters": ', "}"
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps(tail)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    several = parallel and fmt == "hermes" and name is None
    start = 'start: call ("\\n" call)*' if several else "start: call"
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"


@dataclass
class ToolUse:
    """What a chat request's tools ask of its generation."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}, for the chat template
    parser: ToolCallParser  # reads the calls out of the output
    grammar: str | None  # with tool_choice "required" or a named tool: the Lark grammar the output must match

    @classmethod
    def of(cls, tools: list[dict[str, Any]], template_source: str, parallel: bool = True, required: bool = False,
           name: str | None = None) -> ToolUse:
        """A request's tools (checked): the model may call them, or with `required` must call one, or must call
        the tool `name`."""
        fmt = template_format(template_source)
        parser = ToolCallParser(fmt, {t["function"]["name"] for t in tools})
        grammar = call_grammar(tools, fmt, parallel, name) if required or name is not None else None
        return cls(tools, parser, grammar)
