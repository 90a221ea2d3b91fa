"""The wire contract: protobuf requests in, validated engine requests out; engine events back to protobuf.

Pure conversion, no I/O and no tensors, so the server, the in-process CLI and the tests share it.

    wire = parse_request(msg, tokenizer, n_ctx, default_max_new_tokens)   # raises InvalidRequest
    stream = engine.submit(wire.request)
    ... stream_messages(wire, events, texts) / Collector(wire, texts).add(events) ...

Unset fields take the defaults documented in docs/api.md: temperature 1.0, top_p 1.0, repetition
penalty 1.0, a random seed, n 1, and max_new_tokens = min(default_max_new_tokens, the context left
after the prompt).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from attnserve.v1 import generate_pb2 as pb
from model.tokenizer import Tokenizer
from service.errors import InvalidRequest
from service.request import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
    build,
    invalid_request,
)

MAX_REQUEST_ID_CHARS = 128
OPTIONAL_SAMPLING = ("temperature", "top_p", "repetition_penalty", "seed")
FLOAT_SAMPLING = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP: pb.FINISH_REASON_STOP_SEQUENCE,
}


class RequestFields(BaseModel):
    """`GenerateRequest`'s own fields (sampling and stopping are `SamplingParams` / `StoppingCriteria`)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = ""  # up to MAX_REQUEST_ID_CHARS printable ASCII characters, no spaces
    prompt: str = ""
    prompt_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(1, ge=1, le=MAX_N)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprobs: bool = False
    echo: bool = False

    @field_validator("request_id")
    @classmethod
    def _printable(cls, value: str) -> str:
        if len(value) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in value):
            raise InvalidRequest("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters "
                                 f"without spaces; got {len(value)} characters")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestFields:
        if bool(self.prompt) == bool(self.prompt_token_ids):
            raise InvalidRequest("prompt", "give exactly one of prompt and prompt_token_ids"
                                 + (" (both are set)" if self.prompt else " (neither is set)"))
        return self


@dataclass
class WireRequest:
    """A validated request and what the response needs besides the engine's events."""

    request: GenerationRequest  # for the engine; its request_id is unique within this server
    request_id: str  # the id the client gave (or one assigned), echoed in responses and logs
    prompt_text: str  # the prompt as text (decoded from prompt_token_ids if those were given)
    logprobs: bool  # return each token's logprob
    echo: bool  # put the prompt before each completion's text

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs or self.request.top_logprobs > 0


def parse_request(msg: pb.GenerateRequest, tokenizer: Tokenizer, n_ctx: int, default_max_new_tokens: int,
                  max_prompt_chars: int | None = None) -> WireRequest:
    """Validate `msg` and build the engine request; raises `InvalidRequest` naming the field and range."""
    try:
        fields = RequestFields(request_id=msg.request_id, prompt=msg.prompt,
                               prompt_token_ids=list(msg.prompt_token_ids), n=msg.n or 1,
                               top_logprobs=msg.top_logprobs, logprobs=msg.logprobs, echo=msg.echo)
    except ValidationError as e:
        cause = e.errors()[0].get("ctx", {}).get("error")
        raise (cause if isinstance(cause, InvalidRequest) else invalid_request(e, RequestFields)) from None
    if fields.prompt:
        if max_prompt_chars is not None and len(fields.prompt) > max_prompt_chars:
            raise InvalidRequest("prompt", f"{len(fields.prompt)} characters cannot fit the model context of "
                                 f"{n_ctx} tokens (at most {max_prompt_chars} characters)")
        ids, text = tokenizer.encode(fields.prompt), fields.prompt
    else:
        ids, text = fields.prompt_token_ids, None
    sampling = build(SamplingParams, "sampling", sampling_values(msg.sampling))
    stopping = build(StoppingCriteria, "stopping", stopping_values(msg.stopping, len(ids), n_ctx,
                                                                    default_max_new_tokens, msg.truncate_prompt))
    request = GenerationRequest(uuid.uuid4().hex, ids, sampling, stopping, n=fields.n,
                                top_logprobs=fields.top_logprobs, truncate_prompt=msg.truncate_prompt)
    if text is None and fields.echo:
        text = tokenizer.decode(ids) if all(0 <= t < tokenizer.vocab_size for t in ids) else ""
    return WireRequest(request, fields.request_id or request.request_id, text or "", fields.logprobs, fields.echo)


def sampling_values(msg: pb.SamplingParams) -> dict:
    """The set fields of `msg`; unset optional fields are left out so the defaults apply."""
    values = {"top_k": msg.top_k, "min_p": msg.min_p, "presence_penalty": msg.presence_penalty,
              "frequency_penalty": msg.frequency_penalty}
    values.update((name, getattr(msg, name)) for name in OPTIONAL_SAMPLING if msg.HasField(name))
    for name in FLOAT_SAMPLING:
        if name in values:  # float32 on the wire: 0.8 arrives as 0.800000011920929; take the shortest decimal
            values[name] = float(str(np.float32(values[name])))
    return values


def stopping_values(msg: pb.StoppingCriteria, prompt_tokens: int, n_ctx: int, default_max_new_tokens: int,
                    truncate_prompt: bool = False) -> dict:
    """The stopping fields; an unset max_new_tokens takes the default, shrunk to the room the prompt
    leaves unless the prompt may be truncated to make room."""
    room = n_ctx if truncate_prompt else n_ctx - prompt_tokens
    max_new = msg.max_new_tokens or max(1, min(default_max_new_tokens, room))
    return {"max_new_tokens": max_new, "min_new_tokens": msg.min_new_tokens, "stop": list(msg.stop),
            "stop_token_ids": list(msg.stop_token_ids), "ignore_eos": msg.ignore_eos}


# ---- engine events -> protobuf -------------------------------------------------------------------

class TokenTexts:
    """Each token's own text (for logprobs), decoded once."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def token_logprob(event: TokenEvent, texts: TokenTexts) -> pb.TokenLogprob:
    top = [pb.TokenLogprob(token_id=t, logprob=lp, text=texts(t)) for t, lp in event.top_logprobs or ()]
    return pb.TokenLogprob(token_id=event.token_id, logprob=event.logprob, text=texts(event.token_id), top=top)


def usage(wire: WireRequest, events_time: float, completion_tokens: int, state) -> pb.Usage:
    """Counts and timings; `events_time` is when the last token was produced."""
    arrival = state.arrival
    queue = (state.scheduled_at or events_time) - arrival
    ttft = (state.first_token_at or events_time) - arrival
    return pb.Usage(prompt_tokens=len(wire.request.prompt_token_ids), completion_tokens=completion_tokens,
                    queue_ms=1000 * queue, ttft_ms=1000 * ttft, total_ms=1000 * (events_time - arrival))


@dataclass
class StreamState:
    """What a stream has sent so far."""

    started: set[int] = field(default_factory=set)  # indices whose first message went out (for echo)
    completion_tokens: int = 0


def stream_messages(wire: WireRequest, events: list[TokenEvent], texts: TokenTexts, sent: StreamState,
                    state, last: bool) -> list[pb.GenerateStreamResponse]:
    """One message per completion index among `events` (events that arrived together are merged);
    `last` = these events end the request, so the final message carries the usage."""
    by_index: dict[int, list[TokenEvent]] = {}
    for event in events:
        by_index.setdefault(event.index, []).append(event)
    out = []
    for index, evs in by_index.items():
        text = "".join(e.text for e in evs)
        if wire.echo and index not in sent.started:
            text = wire.prompt_text + text
        sent.started.add(index)
        msg = pb.GenerateStreamResponse(request_id=wire.request_id, index=index, text=text,
                                        token_ids=[e.token_id for e in evs])
        if wire.want_logprobs:
            msg.logprobs.extend(token_logprob(e, texts) for e in evs)
        if evs[-1].finish_reason is not None:
            msg.finish_reason = FINISH[evs[-1].finish_reason]
        out.append(msg)
    sent.completion_tokens += len(events)
    if last and out:
        out[-1].usage.CopyFrom(usage(wire, events[-1].time, sent.completion_tokens, state))
    return out


class Collector:
    """Accumulates a request's events into the unary `GenerateResponse`."""

    def __init__(self, wire: WireRequest, texts: TokenTexts):
        self.wire = wire
        self.texts = texts
        n = wire.request.n
        self._text = [[wire.prompt_text] if wire.echo else [] for _ in range(n)]
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[pb.TokenLogprob]] = [[] for _ in range(n)]
        self._finish = [pb.FINISH_REASON_UNSPECIFIED] * n
        self._last_time = 0.0

    def add(self, events: list[TokenEvent]) -> None:
        for e in events:
            self._text[e.index].append(e.text)
            self._ids[e.index].append(e.token_id)
            if self.wire.want_logprobs:
                self._logprobs[e.index].append(token_logprob(e, self.texts))
            if e.finish_reason is not None:
                self._finish[e.index] = FINISH[e.finish_reason]
            self._last_time = e.time

    def response(self, state) -> pb.GenerateResponse:
        completions = [pb.Completion(index=i, text="".join(self._text[i]), token_ids=self._ids[i],
                                     finish_reason=self._finish[i], logprobs=self._logprobs[i])
                       for i in range(self.wire.request.n)]
        tokens = sum(len(ids) for ids in self._ids)
        return pb.GenerateResponse(request_id=self.wire.request_id, completions=completions,
                                   usage=usage(self.wire, self._last_time, tokens, state))
