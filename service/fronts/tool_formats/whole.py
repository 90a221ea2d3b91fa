"""The formats whose calls are the whole output: an output that begins (past whitespace) as calls do is held
to its end and sent as calls only when all of it is calls to the request's tools; otherwise it is text.

    llama3_json  (Llama 3.1-3.3) {"name": "get_weather", "parameters": {...}} ("arguments" is read too),
                 possibly after <|python_tag|>; several calls separated by ";"
    phi4_json    (Phi-4-mini) <|tool_call|>[{"name": "get_weather", "arguments": {...}}, ...]<|/tool_call|>:
                 one or more such blocks, each a list of calls or one call; the tags are special tokens of
                 Phi-4-mini's tokenizer, left out of the output text, so the bare list or call is read too
"""

from __future__ import annotations

import json
from typing import Any, Literal

from service.fronts.tool_formats.base import ParsedMessage, ToolCall, read_call

PYTHON_TAG = "<|python_tag|>"
PHI4_OPEN, PHI4_CLOSE = "<|tool_call|>", "<|/tool_call|>"


class WholeStream:
    """An output that begins with one of `starts` is held to its end, then sent as calls or as text; any
    other is text, sent as it comes."""

    starts: tuple[str, ...] = ()

    def __init__(self, tool_names: frozenset[str]):
        self.tool_names = tool_names
        self.held = ""
        self.mode: Literal["undecided", "text", "held"] = "undecided"

    def feed(self, text: str) -> ParsedMessage:
        self.held += text
        if self.mode == "undecided":
            start = self.held.lstrip()
            if start.startswith(self.starts):
                self.mode = "held"
            elif start and not any(s.startswith(start) for s in self.starts):
                self.mode = "text"
        if self.mode != "text":
            return ParsedMessage()
        piece, self.held = self.held, ""
        return ParsedMessage(piece or None)

    def finish(self) -> ParsedMessage:
        text, self.held = self.held, ""
        calls = self.calls(text.strip()) if self.mode == "held" else None
        return ParsedMessage(calls=calls) if calls else ParsedMessage(text or None)

    def calls(self, text: str) -> list[ToolCall] | None:
        """All of `text` (stripped) as calls, or None."""
        raise NotImplementedError

    def _read(self, values: list[Any] | None, keys: tuple[str, ...]) -> list[ToolCall] | None:
        calls = [read_call(v, self.tool_names, keys) for v in values or []]
        return calls if calls and all(calls) else None


class Llama3Stream(WholeStream):
    starts = ("{", PYTHON_TAG)

    def calls(self, text: str) -> list[ToolCall] | None:
        body = text.removeprefix(PYTHON_TAG).strip()
        decoder, values, at = json.JSONDecoder(), [], 0
        while at < len(body):  # JSON objects separated by ";"
            try:
                value, at = decoder.raw_decode(body, at)
            except ValueError:
                return None
            values.append(value)
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            at = len(body) - len(rest.removeprefix(";").lstrip())
        return self._read(values, ("parameters", "arguments"))


class Phi4Stream(WholeStream):
    starts = ("[", "{", PHI4_OPEN)

    def calls(self, text: str) -> list[ToolCall] | None:
        values: list[Any] = []
        for block in text.split(PHI4_OPEN) if text.startswith(PHI4_OPEN) else [text + PHI4_CLOSE]:
            if not block.strip():
                continue
            body, close, rest = block.partition(PHI4_CLOSE)
            if not close or rest.strip():
                return None
            try:
                value = json.loads(body)
            except ValueError:
                return None
            values.extend(value if isinstance(value, list) else [value])
        return self._read(values, ("arguments", "parameters"))
