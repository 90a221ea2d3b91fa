"""Engine events -> OpenAI's Response object (`POST /v1/responses`), whole or as its stream of events. Pure
conversion, no I/O; a `BodyBuilder` for `HttpFront.generate`.

The output is read as a chat message is (`service.fronts.chat_output`): the reasoning section, the answer and
the calls, as they come. Each becomes an output item, in the order written: a `reasoning` item (its text
one `reasoning_text` part), a `message` item (one `output_text` part) and a `function_call` item per call;
text after a call begins a new message item. An output with none of them is one empty message. Streamed,
every item is announced (`response.output_item.added`), its part opened (`response.content_part.added`),
its text sent as deltas (`response.reasoning_text.delta`, `response.output_text.delta`; a call's arguments
as one `response.function_call_arguments.delta`, once the call is whole), and closed (`….done`, then
`response.output_item.done`). The whole response is the same items: it is built by the same steps.

With logprobs asked for (`include: ["message.output_text.logprobs"]`), each token's logprob and its
`top_logprobs` alternatives go with the answer text it wrote: into its `output_text` part and the delta
that sent the text. A token whose text the reader held back (a possible call's opening) goes with the text
it is released as, and one that wrote nothing (`</think>`, the end of sequence) with the next answer text,
or, last, with the answer being written when the output ends (in a delta of no text); a token read into the
reasoning section or a call carries none, as neither has logprobs. An answer alone thus carries exactly
the chat completion's `logprobs.content`.

    response.created, response.in_progress, <the items' events>, response.completed | response.incomplete
    ... error, response.failed                                    # when the stream fails after it began

Every event is `event: <type>` and `data: <json>` with the stream's `sequence_number`; there is no [DONE].
A response cut off by max_output_tokens is `incomplete` (`incomplete_details.reason: "max_output_tokens"`),
and so is the item it was writing. With `seal_reasoning` (`include: ["reasoning.encrypted_content"]`), a
reasoning item carries its text as `encrypted_content` once it is done.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from service.engine.request import FinishReason, TokenEvent
from service.engine.sequence import Timing
from service.fronts.chat_output import OutputReader
from service.fronts.http.errors import ERROR_CODES
from service.fronts.http.response_streams import sse
from service.fronts.http.responses_schema import sealed
from service.fronts.status import HttpStatus
from service.fronts.token_texts import TokenTexts
from service.fronts.tool_calls import ParsedMessage, ToolCall
from service.fronts.validation import AcceptedRequest

DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
TEXT_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprobs as the text events carry them: tokens and logprobs, without the part's bytes."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


class ResponsesBody:
    """One request's Response, as its events arrive (a Response has one output: n is always 1)."""

    def __init__(self, model: str, accepted: AcceptedRequest, reader: OutputReader | None, echo: dict[str, Any],
                 texts: TokenTexts, seal_reasoning: bool = False):
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        sampling = accepted.request.sampling
        self.echo = {**echo, "temperature": sampling.temperature, "top_p": sampling.top_p}  # the values it ran with
        self.prompt_tokens = len(accepted.request.prompt_token_ids)
        self.timings_of: Callable[[], list[Timing]] = list  # the request's timing record: set once it runs
        self.output_tokens = 0
        self.section_tokens = 0  # tokens read while a reasoning section could be open (reasoning, if there was one)
        self.reader = reader.stream() if reader else None  # None: the text is all answer
        self.texts = texts
        self.seal_reasoning = seal_reasoning  # reasoning items carry their text sealed, for the client to send back
        self.want_logprobs = accepted.want_logprobs
        self.held: list[dict[str, Any]] = []  # logprobs of tokens whose text the reader holds back
        self.finish_reason: FinishReason | None = None
        self.error: dict[str, Any] | None = None
        self.output: list[dict[str, Any]] = []  # the items so far
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written, if any
        self.events: list[bytes] | None = None  # streamed: the events not yet sent; None: not streamed
        self.sequence_number = 0

    # ---- BodyBuilder ----------------------------------------------------------------------------------

    def add(self, stream_index: int, events: list[TokenEvent]) -> None:
        for event in events:
            self._take(event)

    def response(self) -> dict[str, Any]:
        if self.error is not None:
            status = "failed"
        elif self.finish_reason is None:
            status = "in_progress"
        else:
            status = "incomplete" if self.finish_reason == FinishReason.LENGTH else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": self.output, **self.echo,
                "usage": self._usage() if status in ("completed", "incomplete") else None}

    def stream_head(self) -> list[bytes]:
        self.events = []
        for kind in ("response.created", "response.in_progress"):
            self._emit(kind, response=self.response())
        return self._sent()

    def chunks(self, stream_index: int, events: list[TokenEvent]) -> list[bytes]:
        self.add(stream_index, events)
        return self._sent()

    def stream_tail(self) -> list[bytes]:
        response = self.response()
        self._emit(f"response.{response['status']}", response=response)
        return self._sent()

    def stream_error(self, status: HttpStatus) -> list[bytes]:
        code = ERROR_CODES.get(status.status) or status.type
        self._emit("error", code=code, message=status.message, param=status.param)
        self.error = {"code": code, "message": status.message}
        self._emit("response.failed", response=self.response())
        return self._sent()

    # ---- the output items ------------------------------------------------------------------------------

    def _take(self, event: TokenEvent) -> None:
        """One token: its text read for reasoning, answer and calls, written into the items."""
        section = self.reader is not None and self.reader.reasoning is not None and \
            self.reader.reasoning.mode in ("start", "reasoning")
        self.section_tokens += section
        self.output_tokens += 1
        piece = self.reader.feed(event.text) if self.reader else ParsedMessage(event.text or None)
        if event.finish_reason is not None and self.reader:
            piece.extend(self.reader.finish())
        logprobs = self._logprobs(event, piece)
        if piece.reasoning:
            self._write("reasoning", piece.reasoning)
        if piece.content:
            self._write("message", piece.content, logprobs)
        for call in piece.calls:
            self._close("completed")
            self._call(call)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            if self.held and self.open is not None and self.open["type"] == "message":
                self._write("message", "", self.held)
            self._close("incomplete" if event.finish_reason == FinishReason.LENGTH else "completed")
            if not self.output:
                self._open("message")
                self._close("completed")

    def _logprobs(self, event: TokenEvent, piece: ParsedMessage) -> list[dict[str, Any]]:
        """The logprobs that go with `piece`'s answer text: its token's and those of the tokens held back
        before it; none when logprobs were not asked for."""
        if not self.want_logprobs:
            return []
        self.held.append(self.texts.openai_logprob(event.token_id, event.logprob, event.top_logprobs))
        if piece.content:
            released, self.held = self.held, []
            return released
        if piece.reasoning or piece.calls:
            self.held = []
        return []

    def _write(self, kind: str, text: str, logprobs: list[dict[str, Any]] = ()) -> None:
        if self.open is None or self.open["type"] != kind:
            self._close("completed")
            self._open(kind)
        part = self.open["content"][0]
        part["text"] += text
        if kind == "message":
            part["logprobs"] += logprobs
        fields = {"logprobs": logprobs} if kind == "message" else {}
        self._emit(DELTA[kind], **self._where(), content_index=0, delta=text, **fields)

    def _open(self, kind: str) -> None:
        if kind == "message":
            item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open = item
        self._emit("response.output_item.added", output_index=len(self.output) - 1, item=item)
        item["content"].append(part)
        self._emit("response.content_part.added", **self._where(), content_index=0, part=part)

    def _close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        logprobs = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
        self._emit(TEXT_DONE[item["type"]], **where, content_index=0, text=part["text"], **logprobs)
        self._emit("response.content_part.done", **where, content_index=0, part=part)
        item["status"] = status
        if item["type"] == "reasoning" and self.seal_reasoning:
            item["encrypted_content"] = sealed(part["text"])
        self._emit("response.output_item.done", output_index=where["output_index"], item=item)

    def _call(self, call: ToolCall) -> None:
        """A call, whole: its item, its arguments in one delta, and its end."""
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        self._emit("response.output_item.added", output_index=where["output_index"], item=item)
        self._emit("response.function_call_arguments.delta", **where, delta=call.arguments)
        item["arguments"], item["status"] = call.arguments, "completed"
        self._emit("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments)
        self._emit("response.output_item.done", output_index=where["output_index"], item=item)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _usage(self) -> dict[str, Any]:
        reasoned = any(item["type"] == "reasoning" for item in self.output)
        cached = sum(t.cached_tokens for t in self.timings_of())
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.section_tokens if reasoned else 0},
                "total_tokens": self.prompt_tokens + self.output_tokens}

    # ---- the stream -------------------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> None:
        """Streamed: the event, encoded now (its items change after it); a text event's logprobs in the events'
        shape."""
        if self.events is None:
            return
        if "logprobs" in fields:
            fields["logprobs"] = _event_logprobs(fields["logprobs"])
        event = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        self.events.append(f"event: {kind}\n".encode() + sse(event))

    def _sent(self) -> list[bytes]:
        events, self.events = self.events, []
        return events
