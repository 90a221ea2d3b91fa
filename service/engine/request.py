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
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass as validated_dataclass

from service.engine.errors import EngineError, InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100]: -100 bans a token in practice, +100 forces it
PRIORITY_RANGE = (-2**31, 2**31 - 1)  # a request's priority (lower runs first): a signed 32-bit integer

# Parameters are validated when they are built: a value out of range raises pydantic's
# ValidationError (a ValueError); `build` turns it into `InvalidRequest` naming the field and range.
PARAMS = ConfigDict(allow_inf_nan=False, extra="forbid")


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the model produced its end-of-sequence token
    STOP = "stop"  # a stop string or a stop token id matched


@validated_dataclass(config=PARAMS)
class SamplingParams:
    temperature: float = Field(1.0, ge=0.0, le=100.0)  # 0 = greedy (argmax); otherwise logits are divided by it
    top_k: int = Field(0, ge=0)  # keep the k most likely tokens; 0 = all (at most the vocabulary)
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # keep the smallest set whose probability reaches top_p; 1 = all
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # drop tokens less likely than min_p × the most likely one; 0 = none
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # CTRL-style, on prompt and generated tokens; 1 = off
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # subtracted once from every generated token's logit
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # subtracted per occurrence of a generated token
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # per-request RNG seed; None draws one
    # token id -> a bias added to its logit, after the grammar mask and before the penalties (its ids are checked
    # against the vocabulary by `GenerationRequest.validate`)
    logit_bias: dict[int, float] = Field(default_factory=dict)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _biases(cls, value: Any) -> dict[int, float]:
        """At most MAX_LOGIT_BIAS entries, each a token id (an integer, at least 0) -> a finite bias in range;
        InvalidRequest names the entry (`logit_bias.50256`)."""
        if not isinstance(value, dict):
            raise InvalidRequest("logit_bias", f"must map token ids to biases; got {_short(value)}")
        if len(value) > MAX_LOGIT_BIAS:
            raise InvalidRequest("logit_bias", f"has {len(value)} entries; the most allowed is {MAX_LOGIT_BIAS}")
        for token, bias in value.items():
            if not _is_int(token) or token < 0:
                raise InvalidRequest(f"logit_bias.{token}", f"{token!r} is not a token id (an integer, at least 0)")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool):
                raise InvalidRequest(f"logit_bias.{token}", f"must be a number; got {_short(bias)}")
            if isinstance(bias, float) and not math.isfinite(bias):
                raise InvalidRequest(f"logit_bias.{token}", f"{bias!r} is not a finite number")
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise InvalidRequest(f"logit_bias.{token}", f"{_short(bias)} is outside [-100, 100]")
        return {token: float(bias) for token, bias in value.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias)


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


@validated_dataclass(config=PARAMS)
class StoppingCriteria:
    max_new_tokens: int = Field(16, ge=1)  # tokens to generate at most (and at most the engine's limit)
    min_new_tokens: int = Field(0, ge=0)  # EOS, stop ids and stop strings are ignored before this many
    # stop strings, matched across token boundaries, not emitted
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    # ids that end the sequence (emitted as ids, no text)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # keep generating past EOS


def build(cls: type, prefix: str, values: dict[str, Any]):
    """`cls(**values)`, with a bad value reported as `InvalidRequest("<prefix>.<field>", range)`."""
    try:
        return cls(**values)
    except ValidationError as e:
        cause = e.errors()[0].get("ctx", {}).get("error")  # a validator's own InvalidRequest, kept as it is
        if isinstance(cause, InvalidRequest):
            raise InvalidRequest(f"{prefix}.{cause.field}", str(cause).removeprefix(cause.field + ": ")) from None
        raise invalid_request(e, cls, prefix) from None


def invalid_request(error: ValidationError, cls: type, prefix: str = "") -> InvalidRequest:
    """The first error of `error` as `InvalidRequest`, naming the field path and its allowed range."""
    err = error.errors()[0]
    loc = [str(p) for p in err["loc"]]
    path = (prefix + "." if prefix else "") + loc[0] + "".join(f"[{p}]" for p in loc[1:]) if loc else prefix
    bounds = _bounds(cls, loc[0]) if len(loc) == 1 and err["type"] not in ("finite_number",) else None
    value = err.get("input")
    if err["type"] == "finite_number":
        return InvalidRequest(path, f"{value!r} is not a finite number")
    ctx = err.get("ctx", {})
    if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = bounds or (f"[{ctx['ge']}, inf)" if "ge" in ctx else f"({ctx['gt']}, inf)" if "gt" in ctx else
                            f"(-inf, {ctx['le']}]" if "le" in ctx else f"(-inf, {ctx.get('lt')})")
        return InvalidRequest(path, f"{value!r} is outside {bounds}")
    if err["type"] in ("string_too_short", "too_short"):
        return InvalidRequest(path, f"has length {len(value)}; the least allowed is {ctx.get('min_length')}")
    if err["type"] in ("string_too_long", "too_long"):
        return InvalidRequest(path, f"has length {len(value)}; the most allowed is {ctx.get('max_length')}")
    return InvalidRequest(path, f"{err['msg']}; got {_short(value)}")


def _bounds(cls: type, name: str) -> str | None:
    info = getattr(cls, "__pydantic_fields__", {}).get(name)
    if info is None:
        return None
    low = high = None
    low_open = high_open = False
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = m.ge
        elif isinstance(m, annotated_types.Gt):
            low, low_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            high = m.le
        elif isinstance(m, annotated_types.Lt):
            high, high_open = m.lt, True
    if low is None and high is None:
        return None
    return f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}" \
           f"{')' if high_open or high is None else ']'}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class EngineLimits:
    """Request limits that come from the engine config (see `EngineConfig`) and the model context."""

    max_new_tokens: int  # upper bound on a request's max_new_tokens
    max_prompt_tokens: int  # upper bound on the prompt length
    default_max_new_tokens: int  # a request that leaves max_new_tokens unset gets at most this many
    max_n: int = MAX_N
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    encoder_decoder: bool = False  # the prompt is a source, limited on its own; it takes no room from the target

    @classmethod
    def of(cls, config, n_ctx: int, max_source: int | None = None) -> EngineLimits:
        """The limits of an `EngineConfig` on a model of `n_ctx` positions: each at most n_ctx - 1; an
        encoder-decoder's (`max_source` given) prompt at most max_source tokens and its target n_ctx - 1."""
        longest = n_ctx - 1
        max_new = min(config.max_new_tokens or longest, longest)
        prompt = longest if max_source is None else max_source
        return cls(max_new_tokens=max_new, max_prompt_tokens=min(config.max_prompt_tokens or prompt, prompt),
                   default_max_new_tokens=min(config.default_max_new_tokens, max_new),
                   encoder_decoder=max_source is not None)


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """What every sequence of a request must match, as one grammar (`service.engine.grammar` compiles it).

    json_schema  `value` is a JSON schema (JSON text)
    json_object  any JSON object; `value` is empty
    regex        `value` is a regular expression the whole output matches
    choice       `value` is a JSON list of strings; the output is one of them
    grammar      `value` is a Lark-style EBNF grammar (llguidance's dialect) or a GBNF grammar

    With a `lead`, the output is first what the lead's Lark rule `lead` matches (free text such as a reasoning
    section, which a front describes), and only then what `kind` and `value` describe.
    """

    kind: ConstraintKind
    value: str = ""
    lead: str = ""  # Lark grammar text (llguidance's dialect) defining the rule `lead`; "": none


@dataclass(frozen=True)
class BeamParams:
    """Beam search instead of sampling: the `n` best of `width` beams (transformers' `num_beams` rule)."""

    width: int  # beams kept at every step
    length_penalty: float = 1.0  # a hypothesis scores its log-probability / its length ** length_penalty
    early_stopping: bool | Literal["never"] = False  # True: stop once `width` hypotheses are finished


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    n: int = 1  # sequences to generate from the one prompt
    top_logprobs: int = 0  # alternatives to report per token, besides the chosen one
    logprobs: bool = False  # report each token's logprob (implied by top_logprobs > 0)
    deadline: float | None = None  # time.monotonic() after which the request is dropped
    truncate_prompt: bool = False  # drop the prompt's oldest tokens to fit the context instead of refusing
    constraint: Constraint | None = None  # the grammar every sequence's output must match
    # score the prompt: each prompt token's logprob and this many alternatives (None: not computed); such a
    # prompt is computed whole, never taken from the prefix cache
    prompt_logprobs: int | None = None
    speculative: bool = True  # may use speculative decoding where the engine runs it (False: never)
    beam: BeamParams | None = None  # beam search: the n best of beam.width beams, in place of sampling
    # waiting requests are admitted by priority (lower first), then arrival; a running request is never preempted
    # for a more urgent one
    priority: int = 0

    def __post_init__(self):
        self.logprobs = self.logprobs or self.top_logprobs > 0

    @property
    def slots(self) -> int:
        """Sequences the request runs at once: its beams, or its n samples."""
        return self.beam.width if self.beam is not None else self.n

    def validate(self, vocab_size: int, n_ctx: int, limits: EngineLimits) -> None:
        """Raise `InvalidRequest` for the first bad field; may truncate the prompt if asked to."""
        s, st = self.sampling, self.stopping
        if s.top_k > vocab_size:
            raise InvalidRequest("sampling.top_k", f"{s.top_k} is outside [0, {vocab_size}] (the vocabulary)")
        _int_range("n", self.n, 1, limits.max_n)
        _int_range("top_logprobs", self.top_logprobs, 0, limits.max_top_logprobs)
        _int_range("priority", self.priority, *PRIORITY_RANGE)
        for t in s.logit_bias:
            if t >= vocab_size:
                raise InvalidRequest(f"sampling.logit_bias.{t}", f"{t} is outside the vocabulary [0, {vocab_size - 1}]")
        if self.beam is not None:
            self._validate_beam(limits)
        if self.prompt_logprobs is not None:
            if limits.encoder_decoder:
                raise InvalidRequest("prompt_logprobs", "an encoder-decoder's prompt is its source, which the "
                                     "model reads but does not predict: it has no logprobs")
            _int_range("prompt_logprobs", self.prompt_logprobs, 0, limits.max_top_logprobs)
        longest = min(limits.max_new_tokens, n_ctx - 1)
        if not _is_int(st.max_new_tokens) or st.max_new_tokens < 1:  # what is too long is judged with the prompt
            raise InvalidRequest("stopping.max_new_tokens", f"{st.max_new_tokens!r} is outside [1, {longest}]")
        _int_range("stopping.min_new_tokens", st.min_new_tokens, 0, st.max_new_tokens)
        for i, t in enumerate(st.stop_token_ids):
            _int_range(f"stopping.stop_token_ids[{i}]", t, 0, vocab_size - 1)
        if not self.prompt_token_ids:
            raise InvalidRequest("prompt", "is empty; give at least one token")
        given = len(self.prompt_token_ids)
        if limits.encoder_decoder:  # the source takes no room from the target
            _int_range("stopping.max_new_tokens", st.max_new_tokens, 1, longest)
            if len(self.prompt_token_ids) > limits.max_prompt_tokens:
                if not self.truncate_prompt:
                    raise InvalidRequest("prompt", f"{len(self.prompt_token_ids)} tokens exceed the longest source "
                                         f"of {limits.max_prompt_tokens} tokens; shorten it")
                self.prompt_token_ids = self.prompt_token_ids[-limits.max_prompt_tokens:]
        else:
            self._fit_context(n_ctx, limits)
        dropped = given - len(self.prompt_token_ids)
        for i, t in enumerate(self.prompt_token_ids):  # what is left of it: a truncated prompt's kept tokens
            if not (isinstance(t, int) and 0 <= t < vocab_size):
                raise InvalidRequest(f"prompt_token_ids[{i + dropped}]",
                                     f"{t!r} is outside the vocabulary [0, {vocab_size - 1}]")

    def _validate_beam(self, limits: EngineLimits) -> None:
        """Beam search ranks whole hypotheses by the model's log-probabilities: what shapes sampling or a single
        token's choice does not apply, and is refused by name rather than ignored. It does not sample, so its
        temperature is 0 (a seed, as in greedy sampling, chooses nothing and is allowed)."""
        b, s, st = self.beam, self.sampling, self.stopping
        _int_range("beam.width", b.width, 2, limits.max_n)
        _int_range("n", self.n, 1, b.width)
        if not isinstance(b.length_penalty, (int, float)) or not -10.0 <= b.length_penalty <= 10.0:
            raise InvalidRequest("beam.length_penalty", f"{b.length_penalty!r} is outside [-10, 10]")
        if b.early_stopping not in (True, False, "never"):
            raise InvalidRequest("beam.early_stopping", f"{b.early_stopping!r} is not true, false or 'never'")
        if s.temperature != 0.0:
            raise InvalidRequest("sampling.temperature", f"{s.temperature!r} does not apply to beam search, which "
                                 "does not sample: it takes 0")
        refused = {"constraint": self.constraint is not None, "logprobs": self.logprobs,
                   "stopping.stop": bool(st.stop), "stopping.min_new_tokens": st.min_new_tokens > 0,
                   "stopping.ignore_eos": st.ignore_eos, "sampling.top_k": s.top_k > 0, "sampling.top_p": s.top_p < 1.0,
                   "sampling.min_p": s.min_p > 0, "sampling.repetition_penalty": s.repetition_penalty != 1.0,
                   "sampling.presence_penalty": s.presence_penalty != 0.0,
                   "sampling.frequency_penalty": s.frequency_penalty != 0.0, "sampling.logit_bias": s.biased}
        for name, set_ in refused.items():
            if set_:
                raise InvalidRequest(name, "does not apply to beam search, which ranks whole hypotheses by the "
                                     "model's log-probabilities")

    def _fit_context(self, n_ctx: int, limits: EngineLimits) -> None:
        """The prompt and max_new_tokens must fit the context together (a prompt that may be truncated is cut
        to make room), and each its own limit."""
        prompt, max_new = len(self.prompt_token_ids), self.stopping.max_new_tokens
        if max_new >= n_ctx or (prompt + max_new > n_ctx and not self.truncate_prompt):
            # no prompt fits beside max_new_tokens: that is the field to change; otherwise the prompt is
            raise InvalidRequest("stopping.max_new_tokens" if max_new >= n_ctx else "prompt",
                                 context_exceeded(prompt, max_new, n_ctx))
        if max_new > limits.max_new_tokens:
            raise InvalidRequest("stopping.max_new_tokens",
                                 f"{max_new} is outside [1, {limits.max_new_tokens}] (the server's limit)")
        room = min(n_ctx - max_new, limits.max_prompt_tokens)
        if prompt > room:
            if not self.truncate_prompt:
                raise InvalidRequest("prompt", f"{prompt} tokens exceed the server's prompt limit of "
                                     f"{limits.max_prompt_tokens} tokens; shorten it")
            self.prompt_token_ids = self.prompt_token_ids[-room:]


def context_exceeded(prompt: int, max_new: int, n_ctx: int) -> str:
    """The context error as vLLM and OpenAI put it, with the changes that would make the request fit."""
    fixes = [f"lower max_new_tokens to at most {n_ctx - prompt}"] if prompt < n_ctx else []
    fixes += [f"shorten the prompt to at most {n_ctx - max_new} token{'s' * (n_ctx - max_new > 1)}"] \
        if max_new < n_ctx else []
    return (f"prompt {prompt} tokens + max_new_tokens {max_new} exceed the context of {n_ctx}; "
            + (" or ".join(fixes) or f"the prompt and max_new_tokens together may take at most {n_ctx} tokens"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_range(name: str, value: int, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequest(name, f"{value!r} is outside [{low}, {high}]")


# one prompt token's (logprob, its k most likely alternatives as (id, logprob)); None for the first token
PromptLogprob = tuple[float | None, list[tuple[int, float]] | None]
FIRST_PROMPT_LOGPROB: PromptLogprob = (None, None)


@dataclass
class TokenEvent:
    """One generated token of one sequence, with its text delta; the last one carries finish_reason."""

    request_id: str
    index: int  # which of the request's n sequences
    token_id: int
    logprob: float | None  # log-probability of token_id under the model (before sampling adjustments), if asked for
    top_logprobs: list[tuple[int, float]] | None  # the most likely alternatives, when asked for
    text: str  # newly decoded text; may be empty while a character or a stop string is incomplete
    finish_reason: FinishReason | None = None  # set on the sequence's last event
    time: float = 0.0  # time.monotonic() of the step that produced it
    # on each sequence's first event of a request that asked for them: one (logprob, alternatives) per prompt
    # token, the first token's (None, None) (`service.engine.prompt_logprobs`)
    prompt_logprobs: list[PromptLogprob] | None = None
    beam_score: float | None = None  # on a beam search completion's last event: its hypothesis's score
    # on a sequence's last event: the draft tokens speculative decoding had the model check for it, and of those
    # the ones it kept (they are among the sequence's tokens); 0 when it did not speculate
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class Generated:
    """A request run to its end by `Engine.generate`: its events in order, or the error that ended it."""

    request_id: str
    events: list[TokenEvent] = field(default_factory=list)
    error: EngineError | None = None

    def token_ids(self, index: int = 0) -> list[int]:
        """The token ids of the request's sequence `index`."""
        return [e.token_id for e in self.events if e.index == index]
