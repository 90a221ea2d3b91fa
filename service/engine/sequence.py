"""Per-request and per-sequence state inside the engine (the engine thread alone touches it)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from service.engine.beam_search import BeamSearch
from service.engine.detokenizer import TextStream
from service.engine.request import FIRST_PROMPT_LOGPROB, FinishReason, GenerationRequest, PromptLogprob
from service.engine.sampler import SequenceSampling
from service.engine.speculative import Speculation


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILLING = "prefilling"  # has a slot; its prompt is being written chunk by chunk
    DECODING = "decoding"  # prompt written; one token per step
    FINISHED = "finished"


@dataclass(frozen=True)
class Timing:
    """When a request arrived, started its prefill and got its first token (`time.monotonic()`)."""

    arrival: float
    scheduled_at: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


@dataclass(eq=False)
class Sequence:
    request_state: RequestState  # the request this sequence is one of the n samples of
    index: int  # position among the request's n sequences
    sampling: SequenceSampling
    text: TextStream
    slot: int | None = None  # KV slot while it has one
    status: Status = Status.WAITING
    num_prefilled: int = 0  # prompt tokens already in the cache
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matcher: Any = None  # the llguidance matcher of a constrained request, advanced with each token
    speculation: Speculation | None = None  # its drafts so far, once it speculates
    # after a preemption: what its slot must hold again before it decodes on (the prompt and its output but the
    # last token, which it feeds next); None otherwise
    resume: list[int] | None = None

    @property
    def request(self) -> GenerationRequest:
        return self.request_state.request

    @property
    def prompt_len(self) -> int:
        return len(self.request_state.prompt)

    @property
    def prefill_tokens(self) -> list[int]:
        """What its prefill writes: its prompt, or after a preemption the prompt and its output so far."""
        return self.resume if self.resume is not None else self.request_state.prompt


@dataclass(eq=False)
class RequestState:
    request: GenerationRequest
    seed: int  # the request's seed (drawn when it gave none)
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first prefill
    first_token_at: float | None = None
    seqs: list[Sequence] = field(default_factory=list)
    reserved: int = 0  # KV slots promised to siblings not yet forked
    blocks_each: int = 0  # KV blocks each of its sequences got at admission (and each reserved slot holds)
    admitted: int = -1  # admission order (of equally urgent ones, the newest running is preempted first); -1: never
    arrival_order: int = -1  # order of arrival in the waiting queue, kept across preemptions; -1: never queued
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed
    # the prompt's logprobs as its chunks are prefilled, when the request asks for them
    prompt_logprobs: list[PromptLogprob] | None = None
    done: bool = False
    beam: BeamSearch | None = None  # a beam search request's running beams and finished hypotheses

    def __post_init__(self):
        if self.request.prompt_logprobs is not None:
            self.prompt_logprobs = [FIRST_PROMPT_LOGPROB]

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    def timing(self) -> Timing:
        return Timing(self.arrival, self.scheduled_at, self.first_token_at, self.cached_tokens)
