"""A chat choice's output read into OpenAI's message: the reasoning section apart (`service.fronts.reasoning`),
then the calls read out of the answer alone (`service.fronts.tool_calls`), whole or as it streams.

    reader = output_reader(output_start(template.source, prompt), tool_use)   # None: the text is all content
    reader = OutputReader(tool_parser, reasoning_parser)   # either may be None: not read for it
    message = reader.parse(text)                           # ParsedMessage(content, calls, reasoning)
    stream = reader.stream()
    piece = stream.feed(delta) ... stream.finish()         # the pieces add up to parse()
"""

from __future__ import annotations

from dataclasses import dataclass

from service.fronts.reasoning import ReasoningParser, ReasoningStream, SectionStart
from service.fronts.tool_calls import ParsedMessage, ToolCallParser, ToolUse
from service.fronts.tool_formats.base import read_whole


def output_reader(start: SectionStart | None, tools: ToolUse | None) -> OutputReader | None:
    """How a chat request's output is read: for calls when it has tools; for a reasoning section when it may
    write one (`start`: `service.fronts.reasoning.output_start`), constrained or not (a constraint applies after
    the section); None when neither."""
    reasoning = ReasoningParser(start) if start is not None else None
    if tools is None and reasoning is None:
        return None
    return OutputReader(tools.parser if tools else None, reasoning)


@dataclass(frozen=True)
class OutputReader:
    """How one request's output is read."""

    tools: ToolCallParser | None  # None: the answer is all content
    reasoning: ReasoningParser | None  # None: no reasoning section is looked for

    def stream(self) -> OutputStream:
        return OutputStream(self)

    def parse(self, text: str) -> ParsedMessage:
        return read_whole(self.stream(), text)


class OutputStream:
    def __init__(self, reader: OutputReader):
        self.reasoning: ReasoningStream | None = reader.reasoning.stream() if reader.reasoning else None
        self.tools = reader.tools.stream() if reader.tools else None

    def feed(self, text: str) -> ParsedMessage:
        piece = self.reasoning.feed(text) if self.reasoning else ParsedMessage(text or None)
        return self._answer(piece, final=False)

    def finish(self) -> ParsedMessage:
        piece = self.reasoning.finish() if self.reasoning else ParsedMessage()
        return self._answer(piece, final=True)

    def _answer(self, piece: ParsedMessage, final: bool) -> ParsedMessage:
        """`piece` with its answer text read for calls."""
        if self.tools is None:
            return piece
        out = ParsedMessage(reasoning=piece.reasoning)
        out.extend(self.tools.feed(piece.content or ""))
        if final:
            out.extend(self.tools.finish())
        return out
