"""Reasoning sections in a chat model's output: the `<think>…</think>` a reasoning model writes before its
answer (Qwen3, SmolLM3, DeepSeek-R1), read apart from the answer, whole or as it streams.

    start = output_start(template.source, prompt)  # "inside", "before" or "after" a section; None: no sections
    parser = ReasoningParser(start)                # when start is not None
    message = parser.parse(text)                   # ParsedMessage(content, reasoning=...)
    stream = parser.stream()
    piece = stream.feed(delta) ... stream.finish() # the pieces add up to parse()
    lead = reasoning_lead(start, max_chars)        # a constraint's `lead`: its answer comes after the section

An output read from the start of the answer is reasoning only when it begins (past whitespace) with
`<think>`; then the reasoning runs to the first `</think>`, and the answer is what follows. Otherwise it is
all answer, `<think>` further on included. An output that begins inside the section (its prompt ended
with `<think>`, as DeepSeek-R1's generation prompt does) is reasoning up to the first `</think>`. A
section that never closes (cut off by max_tokens) is all reasoning. Whitespace around the reasoning and
before the answer is dropped, as the templates drop it when they render the turn again; an empty
reasoning or answer is None. A prompt that ends with a closed section (Qwen3's with enable_thinking=false)
leaves nothing to reason: the output is all answer.

A constrained output (structured output, a required call) is constrained after the section: its grammar's
`lead` (`service.engine.request.Constraint`) is the section, free text up to `</think>` and the whitespace
after it, which the model must write when the prompt opened the section and may write otherwise. A bound on
the section's characters makes `</think>` the only text the grammar allows once the model has written that many.
"""

from __future__ import annotations

from typing import Literal

from service.fronts.tool_formats.base import ParsedMessage, partial_tag, read_whole

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SectionStart = Literal["inside", "before", "after"]
MAX_GAP = 4  # whitespace a constrained output may write around its section (unbounded, a weak model fills max_tokens)
MAX_REASONING_CHARS = 100_000  # the largest bound a grammar takes on a section (each character is a lexer state)


def template_reasons(source: str) -> bool:
    """Whether a chat template's model writes reasoning sections: the template mentions `<think>`, or
    `</think>` (DeepSeek-R1's first templates only cut the reasoning out of earlier turns)."""
    return THINK_OPEN in source or THINK_CLOSE in source


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning section: it ends with `<think>`."""
    return prompt.rstrip().endswith(THINK_OPEN)


def output_start(template_source: str, prompt: str) -> SectionStart | None:
    """Where a chat output starts: "inside" a reasoning section its prompt opened, "after" one its prompt
    closed (all answer), "before" one it may open; None when its template writes no sections."""
    if not template_reasons(template_source):
        return None
    if prompt.rstrip().endswith(THINK_CLOSE):
        return "after"
    return "inside" if opens_reasoning(prompt) else "before"


def reasoning_lead(start: SectionStart | None, max_chars: int | None = None) -> str:
    """The Lark rule `lead` of a constrained output's reasoning section ("" when it has none to write): the
    section's text up to the first `</think>` (a lazy lexeme) and up to MAX_GAP whitespace characters before and
    after it; required `inside` a
    section, optional `before` one. With `max_chars`, the section's text is at most that many characters, after
    which `</think>` is all the grammar allows."""
    if start is None or start == "after":
        return ""
    text = "(?s:.*)" if max_chars is None else f"(?s:.{{0,{max_chars}}})"
    return "\n".join([
        "lead: think_text GAP?" if start == "inside" else "lead: (THINK_OPEN think_text GAP?)?",
        f'think_text[lazy]: /{text}/ "{THINK_CLOSE}"',
        rf"THINK_OPEN: /\s{{0,{MAX_GAP}}}<think>/",
        rf"GAP: /\s{{1,{MAX_GAP}}}/"])


class ReasoningParser:
    """Reads the reasoning section out of outputs that start where `start` says (`output_start`)."""

    def __init__(self, start: SectionStart = "before"):
        self.start = start

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.start)

    def parse(self, text: str) -> ParsedMessage:
        return read_whole(self.stream(), text)


class ReasoningStream:
    """Answer text is sent as it comes; reasoning too, but for what may begin `</think>` and trailing
    whitespace, held until more reasoning follows."""

    def __init__(self, start: SectionStart):
        modes: dict[SectionStart, Literal["start", "reasoning", "answer"]] = {
            "before": "start", "inside": "reasoning", "after": "answer"}
        self.mode: Literal["start", "reasoning", "after", "answer"] = modes[start]
        self.held = ""
        self.reasoned = False  # reasoning other than whitespace has been sent

    def feed(self, text: str) -> ParsedMessage:
        self.held += text
        out = ParsedMessage()
        while True:
            before = self.mode
            if before == "start":
                self._start()
            elif before == "reasoning":
                self._reasoning(out)
            elif before == "after":
                self._after()
            if self.mode == "answer":
                piece, self.held = self.held, ""
                out.extend(ParsedMessage(piece or None))
                return out
            if self.mode == before:  # waiting for more text
                return out

    def finish(self) -> ParsedMessage:
        out = ParsedMessage()
        if self.mode == "start":  # too short to tell: it is answer
            out.extend(ParsedMessage(self.held or None))
        elif self.mode == "reasoning":  # never closed: all reasoning, but its trailing whitespace
            self._send_reasoning(out, self.held.rstrip())
        self.held = ""
        return out

    def _start(self) -> None:
        begun = self.held.lstrip()
        if begun.startswith(THINK_OPEN):
            self.held, self.mode = begun[len(THINK_OPEN):], "reasoning"
        elif begun and not THINK_OPEN.startswith(begun):
            self.mode = "answer"

    def _reasoning(self, out: ParsedMessage) -> None:
        end = self.held.find(THINK_CLOSE)
        if end >= 0:
            self._send_reasoning(out, self.held[:end].rstrip())
            self.held, self.mode = self.held[end + len(THINK_CLOSE):], "after"
            return
        safe = len(self.held) - partial_tag(self.held, THINK_CLOSE)
        piece = self.held[:safe].rstrip()  # trailing whitespace is held: the section may end after it
        self._send_reasoning(out, piece)
        self.held = self.held[len(piece):]

    def _send_reasoning(self, out: ParsedMessage, piece: str) -> None:
        if not self.reasoned:  # the section's leading whitespace is dropped
            piece = piece.lstrip()
        if piece:
            self.reasoned = True
            out.extend(ParsedMessage(reasoning=piece))

    def _after(self) -> None:
        begun = self.held.lstrip()
        self.held = begun
        if begun:
            self.mode = "answer"
