"""Tool calls in a chat model's output, for any front: the format a model writes them in, the parse of
its text into calls and content (whole or as it streams), and the grammar that makes a model call one.

    fmt = template_format(template.source)              # "hermes", "llama3_json", "phi4_json" or "pythonic"
    parser = ToolCallParser(fmt, {"get_weather", ...})  # the names of the request's tools
    message = parser.parse(text)                        # ParsedMessage(content, calls)
    stream = parser.stream()                            # the same, piece by piece:
    piece = stream.feed(delta) ... stream.finish()      # ParsedMessage per delta; the pieces add up to parse()
    lark = call_grammar(tools, fmt, parallel, name)     # llguidance Lark text for `required` or a named tool
    use = ToolUse.of(tools, template.source, parallel, required, name)   # all of it for one request

The formats, as the families write them (each in `service.fronts.tool_formats`):

    hermes       (Hermes, Qwen2.5, Qwen3, SmolLM3) any text, then one or more blocks
                 <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    llama3_json  (Llama 3.1-3.3) the whole output is {"name": "get_weather", "parameters": {...}}
                 ("arguments" is read too), possibly after <|python_tag|>; several calls separated by ";"
    phi4_json    (Phi-4-mini) the whole output is <|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>,
                 or the list alone (the tags are special tokens, left out of the text)
    pythonic     (Gemma 3 with vLLM's tool template, Llama 3.2 pythonic) the whole output is
                 [get_weather(city="Paris"), local_time()]

`template_format` picks the format from the chat template's text: `<|tool_call|>` or `<|tool|>` means
phi4_json; `<tool_call>` hermes; an example call written `[func_name1(` pythonic; `<|python_tag|>`,
`ipython` or `"parameters"` llama3_json; else hermes, whose tags cannot be mistaken for ordinary text.
A call is one naming one of the request's tools with an object of arguments. A hermes block that is no
call stays text; an output of the whole-output formats is calls only when every call in it is such a
call, and otherwise all of it is text. Text beside calls is the message's content as written, but for
whitespace alone between, before or after calls; a message with no content text has `content` None.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from service.fronts.tool_formats import pythonic
from service.fronts.tool_formats.base import ParsedMessage, ToolCall, read_whole
from service.fronts.tool_formats.hermes import CLOSE as HERMES_CLOSE
from service.fronts.tool_formats.hermes import OPEN as HERMES_OPEN
from service.fronts.tool_formats.hermes import HermesStream
from service.fronts.tool_formats.pythonic import PythonicStream
from service.fronts.tool_formats.whole import PHI4_CLOSE, PHI4_OPEN, Llama3Stream, Phi4Stream

__all__ = ["ParsedMessage", "ToolCall", "ToolCallParser", "ToolUse", "call_grammar", "template_format"]

ToolFormat = Literal["hermes", "llama3_json", "phi4_json", "pythonic"]
STREAMS = {"hermes": HermesStream, "llama3_json": Llama3Stream, "phi4_json": Phi4Stream, "pythonic": PythonicStream}
PHI4_HINTS = re.compile(r"<\|tool_call\|>|<\|tool\|>")
PYTHONIC_HINTS = re.compile(r"\[func_name1?\(")
LLAMA3_HINTS = re.compile(r"<\|python_tag\|>|ipython|[\"']parameters[\"']")
# the JSON layout of a constrained call's arguments: the one json.dumps and templates' tojson write
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def template_format(source: str) -> ToolFormat:
    """The tool-call format a chat template teaches its model (see the module docstring)."""
    if PHI4_HINTS.search(source):
        return "phi4_json"
    if HERMES_OPEN in source:
        return "hermes"
    if PYTHONIC_HINTS.search(source):
        return "pythonic"
    if LLAMA3_HINTS.search(source):
        return "llama3_json"
    return "hermes"


class ToolCallParser:
    """Reads one format's calls to a request's tools out of a model's output."""

    def __init__(self, fmt: ToolFormat, tool_names: set[str]):
        self.format = fmt
        self.tool_names = frozenset(tool_names)

    def stream(self) -> HermesStream | Llama3Stream | Phi4Stream | PythonicStream:
        return STREAMS[self.format](self.tool_names)

    def parse(self, text: str) -> ParsedMessage:
        return read_whole(self.stream(), text)


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
    tool `name`, or calls to any of `tools`: one, or with `parallel` one or more (not llama3_json: Llama 3
    templates take one call per message). Each call's arguments follow its function's `parameters` schema
    (any object when it has none), laid out as `json.dumps` writes JSON; pythonic calls write each argument
    as a keyword whose value is such JSON."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = []
    for i, function in enumerate(functions):
        schema = closed(function.get("parameters") or {"type": "object"})
        if fmt == "pythonic":
            rules.extend(pythonic.call_rules(i, function["name"], schema))
            continue
        given = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**JSON_LAYOUT, **given} if isinstance(given, dict) else JSON_LAYOUT}
        quoted = json.dumps(function["name"])
        if fmt == "hermes":
            head, tail = HERMES_OPEN + '\n{"name": ' + quoted + ', "arguments": ', "}\n" + HERMES_CLOSE
        elif fmt == "phi4_json":
            head, tail = '{"name": ' + quoted + ', "arguments": ', "}"
        else:
            head, tail = '{"name": ' + quoted + ', "parameters": ', "}"
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps(tail)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    several = parallel and fmt != "llama3_json" and name is None
    if fmt == "hermes":
        start = 'start: call ("\\n" call)*' if several else "start: call"
    else:
        opening, closing = {"phi4_json": (PHI4_OPEN + "[", "]" + PHI4_CLOSE), "pythonic": ("[", "]")}.get(fmt, ("", ""))
        repeat = ' ("," " " call)*' if several else ""
        start = f"start: {json.dumps(opening)} call{repeat} {json.dumps(closing)}" if opening else "start: call"
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
