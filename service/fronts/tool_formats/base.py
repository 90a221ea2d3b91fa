"""What every tool-call format reads an output into: calls, and the text beside them."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


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
    """A model's message, or a piece of one: its answer text, its calls and its reasoning."""

    content: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None  # the text of a reasoning section (service.fronts.reasoning)

    def extend(self, other: ParsedMessage) -> None:
        if other.content:
            self.content = (self.content or "") + other.content
        if other.reasoning:
            self.reasoning = (self.reasoning or "") + other.reasoning
        self.calls.extend(other.calls)


def read_whole(stream, text: str) -> ParsedMessage:
    """`text` read through `stream` (anything with `feed` and `finish`) as one piece, then its end: what the
    pieces of that text streamed one by one add up to."""
    message = stream.feed(text)
    message.extend(stream.finish())
    return message


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that begins `tag` (and is not all of it): what a stream
    holds back, since the tag may be completed by the next piece."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)


def read_call(value: Any, tool_names: frozenset[str], arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """`value` as a call: an object naming one of the tools, with an object of arguments (or none) under the
    first of `arguments_keys` it has."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] in tool_names):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
