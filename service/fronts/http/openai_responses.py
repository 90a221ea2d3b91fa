"""Engine events -> OpenAI's response bodies: completions and chat completions, whole or as
server-sent-event chunks. Pure conversion, no I/O.

A request with P prompts and `n` samples has P·n choices; prompt p's sample j is choice p·n + j,
as OpenAI numbers them. Each choice's text is the concatenation of its events' text deltas (the
detokenizer's, so multi-byte characters and stop strings come out whole), after the prompt with `echo`;
with `echo` and logprobs, the prompt's tokens and their logprobs come first (in a stream, in the first chunk).
A chat request with tools, or for a model that writes reasoning sections, reads each choice's text into
`reasoning_content` (and `reasoning`, the same text), content and `tool_calls` (`service.fronts.chat_output`),
whole or as it streams.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.engine.request import FinishReason, TokenEvent
from service.engine.sequence import Timing
from service.fronts.chat_output import OutputReader
from service.fronts.draft_counts import DraftCounts
from service.fronts.http.errors import error_body
from service.fronts.http.response_streams import DONE, sse
from service.fronts.http.timings import timings
from service.fronts.status import HttpStatus
from service.fronts.token_texts import TokenTexts
from service.fronts.tool_calls import ParsedMessage
from service.fronts.validation import AcceptedRequest

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, drafts: DraftCounts) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose keys and values came from the prefix cache; the
    prediction tokens: speculative decoding's draft tokens the model kept and did not keep, as OpenAI's Predicted
    Outputs count the tokens of a prediction (0 without speculative decoding)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": drafts.accepted,
                                          "rejected_prediction_tokens": drafts.rejected}}


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A message's reasoning under both names clients read: vLLM's `reasoning_content` and `reasoning`."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


@dataclass
class Choice:
    """One choice as it accumulates."""

    index: int
    text: list[str] = field(default_factory=list)
    chars: int = 0  # characters of text so far (for text_offset)
    finish_reason: str | None = None
    tokens: int = 0
    beam_score: float | None = None  # a beam search's hypothesis score, once it ends


class ResponseBuilder:
    """What the two endpoints share: the id, the model, the choices' numbering and the counts."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, accepted_requests: list[AcceptedRequest], texts: TokenTexts,
                 include_usage: bool = False):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.accepted_requests = accepted_requests
        self.texts = texts
        self.n = accepted_requests[0].request.n
        self.include_usage = include_usage
        self.choices = [Choice(p * self.n + j) for p in range(len(accepted_requests)) for j in range(self.n)]
        self.prompt_tokens = sum(len(w.request.prompt_token_ids) for w in accepted_requests)
        self.timings_of: Callable[[], list[Timing]] = list  # each request's timing so far: set once they run
        self.last_token_at: float | None = None  # the engine's time of the latest token
        self.drafts = DraftCounts()  # speculative decoding's, over the choices that have ended
        self.want_logprobs = accepted_requests[0].want_logprobs
        self.logprobs = [self._new_logprobs() for _ in self.choices]  # each choice's, whole
        self._echoed: set[int] = set()

    def _new_logprobs(self) -> Any:
        raise NotImplementedError

    def _record(self, targets: tuple[Any, ...], event: TokenEvent, text_offset: int) -> None:
        """Append `event`'s logprob, in the endpoint's shape, to each of `targets`."""
        raise NotImplementedError

    def _record_prompt(self, targets: tuple[Any, ...], accepted: AcceptedRequest, entries: list) -> None:
        """Append the prompt's logprobs (`TokenEvent.prompt_logprobs`), in the endpoint's shape, to each of
        `targets`: completions only, whose echo returns the prompt."""

    def _add(self, stream_index: int, events: list[TokenEvent]) -> dict[int, tuple[str, Any]]:
        """Fold events in; returns each touched choice's new text and, when asked for, its new logprobs."""
        touched: dict[int, tuple[list[str], Any]] = {}
        self.drafts.add(events)
        for e in events:
            self.last_token_at = e.time if self.last_token_at is None else max(self.last_token_at, e.time)
            c = self.choice(stream_index, e)
            delta, lp = touched.setdefault(c.index, ([], self._new_logprobs() if self.want_logprobs else None))
            accepted = self.accepted_requests[stream_index]
            if c.index not in self._echoed:
                self._echoed.add(c.index)
                if accepted.echo:  # completions only: chat never echoes
                    if lp is not None and e.prompt_logprobs is not None:
                        self._record_prompt((lp, self.logprobs[c.index]), accepted, e.prompt_logprobs)
                    delta.append(accepted.prompt_text)
                    c.text.append(accepted.prompt_text)
                    c.chars += len(accepted.prompt_text)
            if accepted.prompt_only:  # max_tokens 0: the token generated is not part of the response
                c.finish_reason = FINISH[FinishReason.LENGTH]
                continue
            if lp is not None:
                self._record((lp, self.logprobs[c.index]), e, c.chars)
            delta.append(e.text)
            c.text.append(e.text)
            c.chars += len(e.text)
            c.tokens += 1
            if e.finish_reason is not None:
                c.finish_reason = FINISH[e.finish_reason]
            if e.beam_score is not None:
                c.beam_score = e.beam_score
        return {i: ("".join(d), lp) for i, (d, lp) in touched.items()}

    def scored(self, choice: dict[str, Any], c: Choice) -> dict[str, Any]:
        """`choice` with the beam search score of `c`, once it has one (an attnserve field)."""
        return choice if c.beam_score is None else {**choice, "beam_score": c.beam_score}

    def add(self, stream_index: int, events: list[TokenEvent]) -> None:
        self._add(stream_index, events)

    def _chunk_choice(self, index: int, text: str, logprobs: Any) -> dict[str, Any] | None:
        """A streamed chunk's entry for one choice: its new text and logprobs (None: nothing to send yet)."""
        raise NotImplementedError

    def chunks(self, stream_index: int, events: list[TokenEvent]) -> list[bytes]:
        """Fold events in; one SSE chunk per choice they touch (and have something to send for). Without a usage
        chunk to come, the chunk that ends the last choice carries the `timings`."""
        entries = [self._chunk_choice(index, text, lp) for index, (text, lp) in self._add(stream_index, events).items()]
        bodies = [self.envelope([entry], chunk=True) for entry in entries if entry is not None]
        if bodies and not self.include_usage and all(c.finish_reason is not None for c in self.choices):
            bodies[-1]["timings"] = self.timings()
        return [sse(body) for body in bodies]

    def choice(self, stream_index: int, event: TokenEvent) -> Choice:
        return self.choices[stream_index * self.n + event.index]

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied, over every prompt."""
        return sum(t.cached_tokens for t in self.timings_of())

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.drafts)

    def timings(self) -> dict[str, Any]:
        """llama.cpp's `timings` of the call so far (`service.fronts.http.timings`)."""
        return timings(self.timings_of(), self.last_token_at, self.prompt_tokens, self.completion_tokens,
                       self.drafts)

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        body = {"id": self.id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}
        if not chunk:
            body["usage"] = self.usage()
            body["timings"] = self.timings()
        elif self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> bytes:
        body = self.envelope([], chunk=True)
        body["usage"] = self.usage()
        body["timings"] = self.timings()
        return sse(body)

    def stream_head(self) -> list[bytes]:
        return []

    def stream_tail(self) -> list[bytes]:
        """The usage chunk when the request asked for it, then [DONE]."""
        return [self.usage_chunk(), DONE] if self.include_usage else [DONE]

    def stream_error(self, status: HttpStatus) -> list[bytes]:
        return [sse(error_body(status)), DONE]


class CompletionBuilder(ResponseBuilder):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def _new_logprobs(self) -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _record(self, targets: tuple[dict[str, list], ...], event: TokenEvent, text_offset: int) -> None:
        self._append(targets, event.token_id, event.logprob, event.top_logprobs, text_offset)

    def _record_prompt(self, targets: tuple[dict[str, list], ...], accepted: AcceptedRequest, entries: list) -> None:
        """The prompt's tokens first: the first has no logprob (null, as in OpenAI's), and each token's
        text_offset counts the texts of the tokens before it."""
        offset = 0
        for token_id, (logprob, top) in zip(accepted.request.prompt_token_ids, entries, strict=True):
            self._append(targets, token_id, logprob, top, offset, first=logprob is None)
            offset += len(self.texts(token_id))

    def _append(self, targets: tuple[dict[str, list], ...], token_id: int, logprob: float | None,
                alternatives: list[tuple[int, float]] | None, text_offset: int, first: bool = False) -> None:
        token = self.texts.openai(token_id)[0]
        top = None
        if not first:
            top = {self.texts.openai(t)[0]: lp for t, lp in alternatives or ()}
            top.setdefault(token, logprob)  # the token itself is always there, as in OpenAI's
        for target in targets:
            target["tokens"].append(token)
            target["token_logprobs"].append(logprob)
            target["top_logprobs"].append(top)
            target["text_offset"].append(text_offset)

    def _chunk_choice(self, index: int, text: str, logprobs: dict | None) -> dict[str, Any]:
        c = self.choices[index]
        return self.scored({"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}, c)

    def response(self) -> dict[str, Any]:
        choices = [self.scored({"index": c.index, "text": "".join(c.text),
                                "logprobs": self.logprobs[c.index] if self.want_logprobs else None,
                                "finish_reason": c.finish_reason}, c) for c in self.choices]
        return self.envelope(choices, chunk=False)


class ChatBuilder(ResponseBuilder):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, accepted_requests: list[AcceptedRequest], texts: TokenTexts,
                 include_usage: bool = False, reader: OutputReader | None = None):
        super().__init__(model, accepted_requests, texts, include_usage)
        self.reader = reader  # None: the text is all content
        self._streams = [reader.stream() for _ in self.choices] if reader else []
        self._calls_sent = [0 for _ in self.choices]

    def _new_logprobs(self) -> list[dict]:
        return []

    def _record(self, targets: tuple[list[dict], ...], event: TokenEvent, text_offset: int) -> None:
        entry = self.texts.openai_logprob(event.token_id, event.logprob, event.top_logprobs)
        for target in targets:
            target.append(entry)

    def stream_head(self) -> list[bytes]:
        """The first chunk of each choice: its role (and no content yet when it may be calls instead)."""
        content = None if self.reader and self.reader.tools else ""
        return [sse(self.envelope([{"index": c.index, "delta": {"role": "assistant", "content": content},
                                    "logprobs": None, "finish_reason": None}], chunk=True)) for c in self.choices]

    def _chunk_choice(self, index: int, text: str, logprobs: list | None) -> dict[str, Any] | None:
        finish_reason = self.choices[index].finish_reason
        delta: dict[str, Any] = {"content": text}
        if self.reader:
            stream = self._streams[index]
            piece = stream.feed(text)
            if finish_reason is not None:
                piece.extend(stream.finish())
            delta = self._delta(index, piece)
            if self._calls_sent[index] and finish_reason is not None:
                finish_reason = "tool_calls"
            if not delta and logprobs is None and finish_reason is None:
                return None
        return self.scored({"index": index, "delta": delta,
                            "logprobs": {"content": logprobs} if logprobs is not None else None,
                            "finish_reason": finish_reason}, self.choices[index])

    def _delta(self, index: int, piece: ParsedMessage) -> dict[str, Any]:
        """A piece of a message as OpenAI streams it (with the reasoning as vLLM's `reasoning_content` and as
        `reasoning`): its reasoning, its content, and its calls numbered from the choice's first."""
        delta: dict[str, Any] = reasoning_fields(piece.reasoning) if piece.reasoning else {}
        if piece.content:
            delta["content"] = piece.content
        if piece.calls:
            first = self._calls_sent[index]
            delta["tool_calls"] = [{"index": first + k, **call.openai()} for k, call in enumerate(piece.calls)]
            self._calls_sent[index] += len(piece.calls)
        return delta

    def _message(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """A choice's whole message and its finish reason."""
        text = "".join(choice.text)
        if self.reader is None:
            return {"role": "assistant", "content": text}, choice.finish_reason
        parsed = self.reader.parse(text)
        message = {"role": "assistant", "content": parsed.content}
        if self.reader.reasoning:
            message.update(reasoning_fields(parsed.reasoning))
        if not parsed.calls:
            return message, choice.finish_reason
        return {**message, "tool_calls": [call.openai() for call in parsed.calls]}, "tool_calls"

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            message, finish_reason = self._message(c)
            choices.append(self.scored({"index": c.index, "message": message,
                                        "logprobs": {"content": self.logprobs[c.index]} if self.want_logprobs
                                        else None, "finish_reason": finish_reason}, c))
        return self.envelope(choices, chunk=False)

