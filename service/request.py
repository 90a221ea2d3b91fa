"""What flows into and out of the engine: requests, their parameters, and per-token events.

Everything here is in token ids; text enters and leaves at the edge (the server tokenizes, the
detokenizer turns ids into text deltas). `GenerationRequest.validate` is the engine's own guard:
every field is checked against the model and the engine limits, and a bad one raises
`InvalidRequest` naming the field and the allowed range.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from service.errors import InvalidRequest


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the model produced its end-of-sequence token
    STOP = "stop"  # a stop string or a stop token id matched


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = all
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one; 0 = none
    repetition_penalty: float = 1.0  # CTRL-style, on prompt and generated tokens; 1 = off
    presence_penalty: float = 0.0  # subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token
    seed: int | None = None  # per-request RNG seed; None draws one

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class StoppingCriteria:
    max_new_tokens: int = 16  # tokens to generate at most
    min_new_tokens: int = 0  # EOS, stop ids and stop strings are ignored before this many
    stop: list[str] = field(default_factory=list)  # stop strings, matched across token boundaries, not emitted
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end the sequence (emitted as ids, no text)
    ignore_eos: bool = False  # keep generating past EOS


@dataclass
class EngineLimits:
    """Request limits that come from the engine config (see `EngineConfig`)."""

    max_new_tokens: int  # upper bound on a request's max_new_tokens
    max_prompt_tokens: int  # upper bound on the prompt length
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_n: int = 16
    max_top_logprobs: int = 20


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    n: int = 1  # sequences to generate from the one prompt
    top_logprobs: int = 0  # alternatives to report per token, besides the chosen one
    deadline: float | None = None  # time.monotonic() after which the request is dropped
    truncate_prompt: bool = False  # drop the prompt's oldest tokens to fit the context instead of refusing

    def validate(self, vocab_size: int, n_ctx: int, limits: EngineLimits) -> None:
        """Raise `InvalidRequest` for the first bad field; may truncate the prompt if asked to."""
        s, st = self.sampling, self.stopping
        _finite_range("sampling.temperature", s.temperature, 0.0, 100.0)
        _int_range("sampling.top_k", s.top_k, 0, vocab_size)
        _finite_range("sampling.top_p", s.top_p, 0.0, 1.0, low_open=True)
        _finite_range("sampling.min_p", s.min_p, 0.0, 1.0)
        _finite_range("sampling.repetition_penalty", s.repetition_penalty, 0.0, 10.0, low_open=True)
        _finite_range("sampling.presence_penalty", s.presence_penalty, -2.0, 2.0)
        _finite_range("sampling.frequency_penalty", s.frequency_penalty, -2.0, 2.0)
        if s.seed is not None:
            _int_range("sampling.seed", s.seed, 0, 2**64 - 1)
        _int_range("n", self.n, 1, limits.max_n)
        _int_range("top_logprobs", self.top_logprobs, 0, limits.max_top_logprobs)
        _int_range("stopping.max_new_tokens", st.max_new_tokens, 1, min(limits.max_new_tokens, n_ctx - 1))
        _int_range("stopping.min_new_tokens", st.min_new_tokens, 0, st.max_new_tokens)
        if len(st.stop) > limits.max_stop_strings:
            raise InvalidRequest("stopping.stop", f"{len(st.stop)} stop strings; at most {limits.max_stop_strings}")
        for i, text in enumerate(st.stop):
            if not text or len(text) > limits.max_stop_string_chars:
                raise InvalidRequest(f"stopping.stop[{i}]",
                                     f"length {len(text)}; must be 1..{limits.max_stop_string_chars} characters")
        for i, t in enumerate(st.stop_token_ids):
            _int_range(f"stopping.stop_token_ids[{i}]", t, 0, vocab_size - 1)
        if not self.prompt_token_ids:
            raise InvalidRequest("prompt", "is empty; give at least one token")
        for i, t in enumerate(self.prompt_token_ids):
            if not (isinstance(t, int) and 0 <= t < vocab_size):
                raise InvalidRequest(f"prompt_token_ids[{i}]", f"{t!r} is outside the vocabulary [0, {vocab_size - 1}]")
        room = min(n_ctx - st.max_new_tokens, limits.max_prompt_tokens)
        if len(self.prompt_token_ids) > room:
            if not self.truncate_prompt:
                raise InvalidRequest("prompt", f"{len(self.prompt_token_ids)} tokens + max_new_tokens "
                                     f"{st.max_new_tokens} exceed the model context of {n_ctx} tokens "
                                     f"(prompt limit {limits.max_prompt_tokens}); shorten it, lower max_new_tokens, "
                                     "or ask for truncation")
            self.prompt_token_ids = self.prompt_token_ids[-room:]


def _finite_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise InvalidRequest(name, f"{value!r} is not a finite number")
    if value > high or value < low or (low_open and value == low):
        raise InvalidRequest(name, f"{value} is outside {'(' if low_open else '['}{low}, {high}]")


def _int_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(name, f"{value!r} is outside [{low}, {high}]")


@dataclass
class TokenEvent:
    """One generated token of one sequence, with its text delta; the last one carries finish_reason."""

    request_id: str
    index: int  # which of the request's n sequences
    token_id: int
    logprob: float  # log-probability of token_id under the model (before sampling adjustments)
    top_logprobs: list[tuple[int, float]] | None  # the most likely alternatives, when asked for
    text: str  # newly decoded text; may be empty while a character or a stop string is incomplete
    finish_reason: FinishReason | None = None  # set on the sequence's last event
