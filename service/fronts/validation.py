"""Requests from any front, checked once, into the engine's `GenerationRequest`.

Every rule is stated once, in the engine's field names (`service.fronts.field_names` gives each front's
spelling). The sampling and stopping parameters' own ranges are in their pydantic definitions
(`service.engine.request`: `SamplingParams`, `StoppingCriteria`), and the rules that depend on the model,
the engine's limits or the request as a whole (vocabulary, context, n, top_logprobs, max_new_tokens, beam
search and what it refuses beside it) in `GenerationRequest.validate`, which the engine runs on every
request. This module adds what only a front sees: the request id, prompt text or token ids and how long a
text may be (`check_text_fits`: a prompt, a chat's rendered messages, a text to tokenize), echo (with
max_new_tokens 0: the prompt alone), beam search's own fields without beam search, and the defaults of
unset fields. A front maps its own wire format to plain values and calls `accept`; a bad value raises
`InvalidRequest` naming the field and its allowed range.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from service.engine.errors import InvalidRequest
from service.engine.request import (
    BeamParams,
    Constraint,
    EngineLimits,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    build,
    invalid_request,
)
from service.runtime.tokenizer import Tokenizer

MAX_REQUEST_ID_CHARS = 128


class RequestFields(BaseModel):
    """A request's own fields, besides its sampling and stopping parameters."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = ""  # up to MAX_REQUEST_ID_CHARS printable ASCII characters, no spaces
    prompt: str = ""
    prompt_token_ids: list[int] = Field(default_factory=list)
    n: int = 1  # ranges: GenerationRequest.validate
    top_logprobs: int = 0
    logprobs: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None  # score the prompt, with this many alternatives per token
    truncate_prompt: bool = False
    constraint: Constraint | None = None  # structured output: the grammar every completion must match
    priority: int = 0  # admission order: lower first (range: GenerationRequest.validate)

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
class AcceptedRequest:
    """A validated request and what a response needs besides the engine's events."""

    request: GenerationRequest  # for the engine; its request_id is unique within this server
    request_id: str  # the id the client gave (or one assigned), echoed in responses and logs
    prompt_text: str  # the prompt as text (decoded from prompt_token_ids if those were given)
    echo: bool  # put the prompt before each completion's text
    prompt_only: bool = False  # echo with max_new_tokens 0: the engine generates one token, left out of the response

    @property
    def want_logprobs(self) -> bool:
        return self.request.logprobs


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know of the served model."""

    tokenizer: Tokenizer
    n_ctx: int
    limits: EngineLimits
    max_prompt_chars: int | None = None  # longer text cannot fit the context, so it is refused untokenized
    sampling_defaults: dict | None = None  # what the model's generation config sets for unset sampling fields


def accept(fields: dict[str, Any], sampling: dict[str, Any], stopping: dict[str, Any], beam: dict[str, Any],
           model: ModelFacts, default_max_new: int | None = None) -> AcceptedRequest:
    """Check a front's values and build the engine request. `sampling`, `stopping` and `beam` (`BeamParams`'
    fields: `width`, given for beam search alone) hold only the fields the client set; the others take their
    defaults (docs/api.md), the model's generation config's where it sets them
    (`service.fronts.generation_defaults`): an unset max_new_tokens is `default_max_new` (else the engine's
    default), shrunk to the room the prompt leaves; a beam search's unset temperature is 0, as it does not
    sample. Raises `InvalidRequest`."""
    try:
        f = RequestFields(**fields)
    except ValidationError as e:
        cause = e.errors()[0].get("ctx", {}).get("error")
        raise (cause if isinstance(cause, InvalidRequest) else invalid_request(e, RequestFields)) from None
    if f.prompt:
        check_text_fits("prompt", f.prompt, model)
        ids, text = model.tokenizer.encode(f.prompt), f.prompt
    else:
        ids, text = f.prompt_token_ids, None
    stopping = dict(stopping)
    prompt_only = f.echo and stopping.get("max_new_tokens") == 0  # the prompt alone (with its logprobs)
    if prompt_only:
        stopping["max_new_tokens"] = 1
    elif stopping.get("max_new_tokens") is None:
        stopping["max_new_tokens"] = default_max_new_tokens(model, len(ids), f.truncate_prompt, default_max_new)
    beam_params = beam_search(beam)
    if beam_params is None:
        sampling = {**(model.sampling_defaults or {}), **sampling}
    else:  # the model's sampling defaults do not apply; a temperature the client set is refused by validate
        sampling = {"temperature": 0.0, **sampling}
    request = GenerationRequest(uuid.uuid4().hex, ids, build(SamplingParams, "sampling", sampling),
                                build(StoppingCriteria, "stopping", stopping), n=f.n, top_logprobs=f.top_logprobs,
                                logprobs=f.logprobs, truncate_prompt=f.truncate_prompt,
                                prompt_logprobs=f.prompt_logprobs, constraint=f.constraint, beam=beam_params,
                                priority=f.priority)
    if text is None and f.echo:
        text = model.tokenizer.decode(ids) if all(0 <= t < model.tokenizer.vocab_size for t in ids) else ""
    return AcceptedRequest(request, f.request_id or request.request_id, text or "", f.echo, prompt_only)


def beam_search(values: dict[str, Any]) -> BeamParams | None:
    """The beam search `values` ask for, None without a `width`: its other fields apply to beam search only,
    and are refused without one. Its ranges are `GenerationRequest.validate`'s."""
    if "width" not in values:
        if values:
            raise InvalidRequest(f"beam.{next(iter(values))}", "applies to beam search only, which this request "
                                 "does not ask for")
        return None
    return BeamParams(**values)


def check_text_fits(field: str, text: str, model: ModelFacts) -> None:
    """Refuse, before tokenizing it, a text too long to fit the model's prompt whatever its tokens: more
    characters than the longest prompt (an encoder-decoder's: its longest source) times the longest token."""
    if model.max_prompt_chars is None or len(text) <= model.max_prompt_chars:
        return
    room = (f"the longest source of {model.limits.max_prompt_tokens}" if model.limits.encoder_decoder
            else f"the model context of {model.n_ctx}")
    raise InvalidRequest(field, f"has {len(text)} characters; the limit is {model.max_prompt_chars} (no longer text "
                         f"can fit {room} tokens)")


def usable_prompt_ids(ids: Sequence[int], truncate: bool, model: ModelFacts) -> list[int]:
    """A prompt's token ids as a list, cut to what could ever be used before any per-token work: the
    last ones that fit the model of a prompt that may be truncated (the engine cuts it further to make
    room for the completion); a prompt that may not be, and is longer, is refused at once."""
    longest = model.limits.max_prompt_tokens if model.limits.encoder_decoder else model.n_ctx
    if len(ids) <= longest:
        return list(ids)
    if truncate:
        return list(ids[-longest:])
    room = "longest source" if model.limits.encoder_decoder else "model context"
    raise InvalidRequest("prompt", f"{len(ids)} tokens cannot fit the {room} of {longest} tokens; shorten it")


def default_max_new_tokens(model: ModelFacts, prompt_tokens: int, truncate_prompt: bool,
                           default: int | None = None) -> int:
    """An unset max_new_tokens: `default` or the engine's, shrunk to the room the prompt leaves (unless
    the prompt may be truncated to make room)."""
    if model.limits.encoder_decoder:  # the source takes no room from the target
        room = model.n_ctx - 1
    else:
        room = model.n_ctx if truncate_prompt else model.n_ctx - prompt_tokens
    return max(1, min(default or model.limits.default_max_new_tokens, model.limits.max_new_tokens, room))
