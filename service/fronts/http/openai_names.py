"""The engine's field names as an OpenAI request spells them (`service.fronts.field_names`): `max_tokens`,
not `stopping.max_new_tokens`; `best_of`, not `beam.width`. Most are the same on every request; the rest
depend on the endpoint and the body (which field set the constraint, which of a chat's two max token
fields was sent), so each request's table is built once, before anything is checked, and only read after.

    names = completion_names(constraint_field)        # or chat_names(body, constraint_field)
    raise names.renamed(error)
"""

from __future__ import annotations

from service.engine.request import SamplingParams
from service.fronts.field_names import FieldNames
from service.fronts.http.openai_schema import ChatCompletionRequest

# the engine's field names -> the OpenAI request's, on both endpoints (an item is named by its list: `stop`)
OPENAI_NAMES = {
    "prompt_token_ids": "prompt", "stopping.max_new_tokens": "max_tokens", "stopping.min_new_tokens": "min_tokens",
    "stopping.stop": "stop", "stopping.stop_token_ids": "stop_token_ids", "stopping.ignore_eos": "ignore_eos",
    **{f"sampling.{name}": name for name in SamplingParams.__dataclass_fields__},
    "beam.width": "best_of", "beam.length_penalty": "length_penalty", "beam.early_stopping": "early_stopping",
}
# /v1/completions: `logprobs` is the number of alternatives, and with `echo` also the prompt's
COMPLETION_NAMES = {"top_logprobs": "logprobs", "prompt_logprobs": "logprobs"}


def completion_names(constraint_field: str) -> FieldNames:
    """A /v1/completions request's names; `constraint_field`: the field that set its constraint ("" for none)."""
    return _names(COMPLETION_NAMES, constraint_field)


def chat_names(body: ChatCompletionRequest, constraint_field: str) -> FieldNames:
    """A /v1/chat/completions request's names: its prompt is its messages, and its max_new_tokens the field
    the body sent (`max_tokens`, else `max_completion_tokens`)."""
    max_tokens = "max_completion_tokens" if body.max_tokens is None and body.max_completion_tokens is not None \
        else "max_tokens"
    return _names({"prompt": "messages", "prompt_token_ids": "messages", "stopping.max_new_tokens": max_tokens},
                  constraint_field)


def _names(endpoint: dict[str, str], constraint_field: str) -> FieldNames:
    constraint = {"constraint": constraint_field} if constraint_field else {}
    return FieldNames({**OPENAI_NAMES, **endpoint, **constraint}, keep_index=False)
