"""Engine events -> Anthropic's Message, whole or as its stream of server-sent events (a `BodyBuilder`). Pure
conversion, no I/O.

A message's content is its blocks in order: a `thinking` block when the model reasoned (its chat template
opens reasoning sections: `service.fronts.reasoning`), a `text` block with the answer, then a `tool_use` block
per call read from the answer (`service.fronts.chat_output`). A message without calls always has its text
block, empty if need be. Its `stop_reason`: `tool_use` when it holds calls, else `max_tokens`,
`stop_sequence` (with the `stop_sequence` that matched) or `end_turn`.

Streamed, the events are Anthropic's:

    event: message_start          {"message": the message, its content empty, its usage the prompt's}
    event: content_block_start    {"index": i, "content_block": the block, its text (or input) empty}
    event: content_block_delta    {"index": i, "delta": text_delta | thinking_delta | input_json_delta}
    event: content_block_stop     {"index": i}
    ...                           each block in turn, as its text comes
    event: message_delta          {"delta": {"stop_reason", "stop_sequence"}, "usage": the counts}
    event: message_stop
    event: error                  {"type": "error", "error": {...}}, in place of what is left, if it fails

Text and reasoning stream as they come; a call is sent whole (its `input_json_delta` is its whole input)
once it is read. Usage counts as Anthropic's does: `input_tokens` are the prompt tokens the model computed,
`cache_read_input_tokens` those the prefix cache supplied (their sum is the prompt's length, what
/v1/messages/count_tokens answers).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from service.engine.request import FinishReason, TokenEvent
from service.engine.sequence import Timing
from service.fronts.chat_output import OutputReader, OutputStream
from service.fronts.http.anthropic_errors import anthropic_error_body
from service.fronts.status import HttpStatus
from service.fronts.tool_calls import ParsedMessage, ToolCall
from service.fronts.validation import AcceptedRequest
from service.runtime.tokenizer import Tokenizer


def event(body: dict[str, Any]) -> bytes:
    """One server-sent event, named by its body's type, as Anthropic sends them."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"event: {body['type']}\ndata: {data}\n\n".encode()


def tool_use(call: ToolCall, streamed: bool = False) -> dict[str, Any]:
    """A call as a tool_use block: its input an object (empty at the start of a streamed block)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": {} if streamed else json.loads(call.arguments)}


def matched_stop(text: str, ids: list[int], stops: list[str], tokenizer: Tokenizer) -> str | None:
    """Which of `stops` ended an output whose text (the stop string cut off) is `text`: the one found first
    in the output's whole decoding from where the text ends (the shortest when several start there, as it
    matched first); None when none did (a stop token ended it)."""
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    found = [(at, len(s), s) for s in stops if (at := whole.find(s, len(text))) >= 0]
    return min(found)[2] if found else None


class MessageBuilder:
    """One Message (Anthropic's answers have one choice), built from its request's events."""

    def __init__(self, model: str, accepted: AcceptedRequest, reader: OutputReader | None, tokenizer: Tokenizer,
                 stop_sequences: list[str]):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.reader = reader  # None: the text is all answer
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences
        self.prompt_tokens = len(accepted.request.prompt_token_ids)
        self.timings_of: Callable[[], list[Timing]] = list  # the request's timing record: set once it runs
        self.text: list[str] = []
        self.ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        # streaming: how many blocks were started, the type of the open one
        self._stream: OutputStream | None = reader.stream() if reader else None
        self._blocks = 0
        self._open: str | None = None
        self._texted = False  # a text block was started
        self._called = False  # a tool_use block was sent

    # ---- whole ----------------------------------------------------------------------------------

    def add(self, stream_index: int, events: list[TokenEvent]) -> None:
        for e in events:
            self.ids.append(e.token_id)
            self.text.append(e.text)
            if e.finish_reason is not None:
                self.finish_reason = e.finish_reason

    def response(self) -> dict[str, Any]:
        text = "".join(self.text)
        parsed = self.reader.parse(text) if self.reader else ParsedMessage(text)
        content: list[dict[str, Any]] = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content or not parsed.calls:
            content.append({"type": "text", "text": parsed.content or ""})
        content.extend(tool_use(call) for call in parsed.calls)
        stop_reason, stop_sequence = self._stop(bool(parsed.calls))
        return {**self._message(content, stop_reason, stop_sequence), "usage": self.usage()}

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence}

    def _stop(self, called: bool) -> tuple[str, str | None]:
        """The message's stop_reason and stop_sequence."""
        if called:
            return "tool_use", None
        if self.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        if self.finish_reason is FinishReason.STOP and self.stop_sequences:
            matched = matched_stop("".join(self.text), self.ids, self.stop_sequences, self.tokenizer)
            if matched is not None:
                return "stop_sequence", matched
        return "end_turn", None

    def usage(self) -> dict[str, int]:
        cached = sum(t.cached_tokens for t in self.timings_of())  # prompt tokens the prefix cache supplied
        return {"input_tokens": self.prompt_tokens - cached, "cache_read_input_tokens": cached,
                "output_tokens": len(self.ids)}

    # ---- streamed -------------------------------------------------------------------------------

    def stream_head(self) -> list[bytes]:
        """message_start: the message with no content yet, and the prompt's tokens (which of them the prefix
        cache held is known at the end, in message_delta)."""
        message = {**self._message([], None, None), "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [event({"type": "message_start", "message": message})]

    def chunks(self, stream_index: int, events: list[TokenEvent]) -> list[bytes]:
        self.add(stream_index, events)
        text = "".join(e.text for e in events)
        piece = self._stream.feed(text) if self._stream else ParsedMessage(text or None)
        if self.finish_reason is not None and self._stream:
            piece.extend(self._stream.finish())
        out = self._blocks_of(piece)
        if self.finish_reason is not None:
            if not self._called and not self._texted:
                out += self._start({"type": "text", "text": ""})  # a message without calls has its text block
            out += self._close()
        return out

    def _blocks_of(self, piece: ParsedMessage) -> list[bytes]:
        """A piece of the message as block events: reasoning, then text, then calls (each whole)."""
        out: list[bytes] = []
        if piece.reasoning:
            if self._open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.content:
            if self._open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.calls:
            self._called = True
            out += self._start(tool_use(call, streamed=True))
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            out += self._close()
        return out

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._open = block["type"]
        self._texted = self._texted or block["type"] == "text"
        self._blocks += 1
        return out + [event({"type": "content_block_start", "index": self._blocks - 1, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event({"type": "content_block_stop", "index": self._blocks - 1})]

    def stream_tail(self) -> list[bytes]:
        """message_delta (why it stopped, and the counts), then message_stop."""
        stop_reason, stop_sequence = self._stop(self._called)
        return [event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": self.usage()}),
                event({"type": "message_stop"})]

    def stream_error(self, status: HttpStatus) -> list[bytes]:
        return [event(anthropic_error_body(status))]
