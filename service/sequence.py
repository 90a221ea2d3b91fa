"""Per-request and per-sequence state inside the engine (the engine thread alone touches it)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from service.detokenizer import TextStream
from service.request import FinishReason, GenerationRequest
from service.sampler import SamplingState


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILLING = "prefilling"  # has a slot; its prompt is being written chunk by chunk
    DECODING = "decoding"  # prompt written; one token per step
    FINISHED = "finished"


@dataclass
class Sequence:
    request: RequestState
    index: int  # position among the request's n sequences
    sampling: SamplingState
    text: TextStream
    slot: int | None = None  # KV slot while it has one
    status: Status = Status.WAITING
    num_prefilled: int = 0  # prompt tokens already in the cache
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens; the last generated one is not in the cache yet."""
        return self.prompt_len + len(self.output_ids)


@dataclass
class RequestState:
    request: GenerationRequest
    seed: int  # the request's seed (drawn when it gave none)
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first prefill
    first_token_at: float | None = None
    seqs: list[Sequence] = field(default_factory=list)
    reserved: int = 0  # KV slots promised to siblings not yet forked
    done: bool = False

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids
