"""hermes (Hermes, Qwen2.5, Qwen3, SmolLM3): any text, then one or more blocks
`<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`. A block is a call when its
JSON is an object naming one of the request's tools with an object of arguments; any other block stays text."""

from __future__ import annotations

import json

from service.fronts.tool_formats.base import ParsedMessage, ToolCall, partial_tag, read_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream:
    """Text is sent as it comes, but for what may begin a `<tool_call>` block; a block is held until it
    closes, then sent as a call or, if it is none, as text. Whitespace alone between calls, or before or
    after them, is dropped (held until text or a call follows)."""

    def __init__(self, tool_names: frozenset[str]):
        self.tool_names = tool_names
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
            start = self.held.find(OPEN, self.scan)
            end = self.held.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
            if final and end < 0:  # the rest is text, but whitespace alone after a call
                if self.has_text or self.held.strip() or not self.called:
                    self._send(out, len(self.held), final)
                self.held = ""
                return out
            if start < 0:  # hold a suffix that may begin a block
                self._send(out, len(self.held) - partial_tag(self.held[self.scan:], OPEN))
                return out
            self._send(out, start)
            if end < 0:
                return out
            start = self.held.find(OPEN, self.scan)
            end = self.held.find(CLOSE, start + len(OPEN))
            call = self._block(self.held[start + len(OPEN):end])
            if call is None:  # not a call: the block is text
                self.scan = end + len(CLOSE)
                continue
            self.held = self.held[end + len(CLOSE):]  # whitespace alone before the call is dropped
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
        return read_call(value, self.tool_names, ("arguments", "parameters"))
