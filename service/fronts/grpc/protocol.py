"""The gRPC wire format: protobuf requests in, engine events back out as protobuf.

Pure conversion, no I/O and no tensors, so the servicer, the in-process CLI and the tests share it.
The checks and defaults are every front's (`service.fronts.validation`); the proto spells the engine's
fields as the engine does but for beam search's (`GRPC_NAMES`), which errors are given in.

    accepted = parse_request(msg, model)         # raises InvalidRequest, in the engine's names
    stream = engine.submit(accepted.request)
    ... stream_messages(accepted, events, texts, ...) / Collector(accepted, texts).add(events) ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from attnserve.v1 import generate_pb2 as pb
from service.engine.errors import InvalidRequest
from service.engine.request import Constraint, FinishReason, TokenEvent
from service.engine.sequence import Timing
from service.fronts.draft_counts import DraftCounts
from service.fronts.field_names import FieldNames
from service.fronts.token_texts import TokenTexts
from service.fronts.validation import AcceptedRequest, ModelFacts, accept, usable_prompt_ids

OPTIONAL_SAMPLING = ("temperature", "top_p", "repetition_penalty", "seed")
FLOAT_SAMPLING = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP: pb.FINISH_REASON_STOP_SEQUENCE,
}
# the engine's fields the proto spells otherwise: its beam search fields sit on GenerateRequest itself
GRPC_NAMES = FieldNames({"beam.width": "beam_width", "beam.length_penalty": "length_penalty",
                         "beam.early_stopping": "beam_stopping"})


def parse_request(msg: pb.GenerateRequest, model: ModelFacts) -> AcceptedRequest:
    """Validate `msg` and build the engine request; raises `InvalidRequest` naming the field and range."""
    ids = usable_prompt_ids(msg.prompt_token_ids, msg.truncate_prompt, model)
    fields = {"request_id": msg.request_id, "prompt": msg.prompt, "prompt_token_ids": ids,
              "n": msg.n or 1, "top_logprobs": msg.top_logprobs, "logprobs": msg.logprobs, "echo": msg.echo,
              "truncate_prompt": msg.truncate_prompt, "constraint": constraint(msg),
              "prompt_logprobs": msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
              "priority": msg.priority}
    return accept(fields, sampling_values(msg.sampling), stopping_values(msg.stopping), beam_values(msg), model)


def constraint(msg: pb.GenerateRequest) -> Constraint | None:
    """The request's `constraint` oneof as the engine's `Constraint`."""
    which = msg.WhichOneof("constraint")
    if which is None:
        return None
    if which == "json_object":
        if not msg.json_object:
            raise InvalidRequest("json_object", "set it to true, or leave the constraint unset")
        return Constraint("json_object")
    if which == "choice":
        return Constraint("choice", json.dumps(list(msg.choice.choices)))
    return Constraint(which, getattr(msg, which))


BEAM_STOPPING = {pb.BEAM_STOPPING_HEURISTIC: False, pb.BEAM_STOPPING_EARLY: True, pb.BEAM_STOPPING_NEVER: "never"}


def beam_values(msg: pb.GenerateRequest) -> dict:
    """The set beam search fields, as `BeamParams`' (width 0 and BEAM_STOPPING_HEURISTIC mean unset)."""
    values = {}
    if msg.beam_width:
        values["width"] = msg.beam_width
    if msg.HasField("length_penalty"):
        values["length_penalty"] = _decimal(msg.length_penalty)
    if msg.beam_stopping:
        if msg.beam_stopping not in BEAM_STOPPING:
            raise InvalidRequest("beam_stopping", f"{msg.beam_stopping} is not a BeamStopping value")
        values["early_stopping"] = BEAM_STOPPING[msg.beam_stopping]
    return values


def sampling_values(msg: pb.SamplingParams) -> dict:
    """The set fields of `msg`; unset optional fields are left out so the defaults apply."""
    values = {"top_k": msg.top_k, "min_p": msg.min_p, "presence_penalty": msg.presence_penalty,
              "frequency_penalty": msg.frequency_penalty}
    values.update((name, getattr(msg, name)) for name in OPTIONAL_SAMPLING if msg.HasField(name))
    for name in FLOAT_SAMPLING:
        if name in values:
            values[name] = _decimal(values[name])
    if msg.logit_bias:
        values["logit_bias"] = {token: _decimal(bias) for token, bias in msg.logit_bias.items()}
    return values


def _decimal(value: float) -> float:
    """A float32 field at its shortest decimal form: 0.8 arrives as 0.800000011920929, and is taken as 0.8."""
    return float(str(np.float32(value)))


def stopping_values(msg: pb.StoppingCriteria) -> dict:
    """The stopping fields; max_new_tokens 0 means unset (the default applies)."""
    return {"max_new_tokens": msg.max_new_tokens or None, "min_new_tokens": msg.min_new_tokens, "stop": list(msg.stop),
            "stop_token_ids": list(msg.stop_token_ids), "ignore_eos": msg.ignore_eos}


# ---- engine events -> protobuf -------------------------------------------------------------------

def token_logprob(event: TokenEvent, texts: TokenTexts) -> pb.TokenLogprob:
    return _token_logprob(event.token_id, event.logprob, event.top_logprobs, texts)


def _token_logprob(token_id: int, logprob: float, alternatives: list[tuple[int, float]] | None,
                   texts: TokenTexts) -> pb.TokenLogprob:
    top = [pb.TokenLogprob(token_id=t, logprob=lp, text=texts(t)) for t, lp in alternatives or ()]
    return pb.TokenLogprob(token_id=token_id, logprob=logprob, text=texts(token_id), top=top)


def prompt_logprobs(accepted: AcceptedRequest, event: TokenEvent, texts: TokenTexts) -> list[pb.TokenLogprob]:
    """The prompt's logprobs an event carries (`TokenEvent.prompt_logprobs`), but the first token's: it has none."""
    pairs = zip(accepted.request.prompt_token_ids, event.prompt_logprobs or (), strict=False)
    return [_token_logprob(t, lp, top, texts) for t, (lp, top) in pairs if lp is not None]


def usage(accepted: AcceptedRequest, events_time: float, completion_tokens: int, timing: Timing,
          drafts: DraftCounts) -> pb.Usage:
    """Counts and timings; `events_time` is when the last token was produced."""
    arrival = timing.arrival
    queue = (timing.scheduled_at or events_time) - arrival
    ttft = (timing.first_token_at or events_time) - arrival
    return pb.Usage(prompt_tokens=len(accepted.request.prompt_token_ids), completion_tokens=completion_tokens,
                    queue_ms=1000 * queue, ttft_ms=1000 * ttft, total_ms=1000 * (events_time - arrival),
                    cached_prompt_tokens=timing.cached_tokens, draft_tokens=drafts.proposed,
                    accepted_draft_tokens=drafts.accepted)


@dataclass
class StreamProgress:
    """What a GenerateStream call has sent so far: which completions have begun, whether the prompt's logprobs
    went out, and the counts its last message's usage reports."""

    started: set[int] = field(default_factory=set)  # indices whose first message went out (for echo)
    prompt_logprobs_sent: bool = False  # they go out once, in the request's first message
    completion_tokens: int = 0
    drafts: DraftCounts = field(default_factory=DraftCounts)  # of the sequences that have ended


def stream_messages(accepted: AcceptedRequest, events: list[TokenEvent], texts: TokenTexts, sent: StreamProgress,
                    timing: Timing, last: bool) -> list[pb.GenerateStreamResponse]:
    """One message per completion index among `events` (events that arrived together are merged);
    `last` = these events end the request, so the final message carries the usage."""
    by_index: dict[int, list[TokenEvent]] = {}
    for event in events:
        by_index.setdefault(event.index, []).append(event)
    out = []
    for index, evs in by_index.items():
        text = "".join(e.text for e in evs)
        if accepted.echo and index not in sent.started:
            text = accepted.prompt_text + text
        sent.started.add(index)
        msg = pb.GenerateStreamResponse(request_id=accepted.request_id, index=index, text=text,
                                        token_ids=[e.token_id for e in evs])
        if accepted.want_logprobs:
            msg.logprobs.extend(token_logprob(e, texts) for e in evs)
        if evs[0].prompt_logprobs is not None and not sent.prompt_logprobs_sent:
            sent.prompt_logprobs_sent = True
            msg.prompt_logprobs.extend(prompt_logprobs(accepted, evs[0], texts))
        if evs[-1].finish_reason is not None:
            msg.finish_reason = FINISH[evs[-1].finish_reason]
        if evs[-1].beam_score is not None:
            msg.beam_score = evs[-1].beam_score
        out.append(msg)
    sent.completion_tokens += len(events)
    sent.drafts.add(events)
    if last and out:
        out[-1].usage.CopyFrom(usage(accepted, events[-1].time, sent.completion_tokens, timing, sent.drafts))
    return out


class Collector:
    """Accumulates a request's events into the unary `GenerateResponse`."""

    def __init__(self, accepted: AcceptedRequest, texts: TokenTexts):
        self.accepted = accepted
        self.texts = texts
        n = accepted.request.n
        self._text = [[accepted.prompt_text] if accepted.echo else [] for _ in range(n)]
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[pb.TokenLogprob]] = [[] for _ in range(n)]
        self._finish = [pb.FINISH_REASON_UNSPECIFIED] * n
        self._scores: list[float | None] = [None] * n  # a beam search's hypothesis scores
        self._last_time = 0.0
        self._prompt_logprobs: list[pb.TokenLogprob] = []
        self._drafts = DraftCounts()

    def add(self, events: list[TokenEvent]) -> None:
        self._drafts.add(events)
        for e in events:
            if e.prompt_logprobs is not None and not self._prompt_logprobs:
                self._prompt_logprobs = prompt_logprobs(self.accepted, e, self.texts)
            self._text[e.index].append(e.text)
            self._ids[e.index].append(e.token_id)
            if self.accepted.want_logprobs:
                self._logprobs[e.index].append(token_logprob(e, self.texts))
            if e.finish_reason is not None:
                self._finish[e.index] = FINISH[e.finish_reason]
            if e.beam_score is not None:
                self._scores[e.index] = e.beam_score
            self._last_time = e.time

    def response(self, timing: Timing) -> pb.GenerateResponse:
        completions = [pb.Completion(index=i, text="".join(self._text[i]), token_ids=self._ids[i],
                                     finish_reason=self._finish[i], logprobs=self._logprobs[i],
                                     beam_score=self._scores[i])
                       for i in range(self.accepted.request.n)]
        tokens = sum(len(ids) for ids in self._ids)
        return pb.GenerateResponse(request_id=self.accepted.request_id, completions=completions,
                                   usage=usage(self.accepted, self._last_time, tokens, timing, self._drafts),
                                   prompt_logprobs=self._prompt_logprobs)
