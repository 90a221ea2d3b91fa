"""Prompt logprobs: each prompt token's log-probability under the model, from the logits the prefill
already computes at every prompt position, for the requests that ask (`GenerationRequest.prompt_logprobs`).

    record(states, logits, start, sampleable)   # a prefill's logits [rows, positions, vocab], its rows' states
    entries = score(logits, prompt, start, k, sampleable)   # logits [len(chunk), vocab] of positions start, ...

Position i's logits give token i + 1's logprob, so a chunk scores the tokens after each of its positions
that lie inside the prompt (the last position's logits give the first generated token instead). The first
prompt token has none: its entry is `FIRST_PROMPT_LOGPROB` (`request.py`, beside the event that carries
them). Like the generated tokens' logprobs (`sampler.with_logprobs`), they are the log-softmax of the raw
logits over the ids the model can emit (`sampleable`: not a padded vocabulary's ids past the tokenizer's),
and the k alternatives are the most likely of those, most likely first.
"""

from __future__ import annotations

import numpy as np

from service.engine.request import PromptLogprob
from service.engine.sampler import log_partition, most_likely
from service.engine.sequence import RequestState


def score(logits: np.ndarray, prompt: list[int], start: int, k: int, sampleable: int) -> list[PromptLogprob]:
    """The entries of prompt tokens start + 1 ... start + len(logits) (those the prompt has), from the logits
    of positions start ... start + len(logits) - 1; with k alternatives each (None when k is 0), among ids
    [0, sampleable)."""
    targets = prompt[start + 1:start + 1 + len(logits)]
    if not targets:
        return []
    x = logits[:len(targets)]
    emitted = x[:, :sampleable]
    lse = log_partition(emitted)
    chosen = (x[np.arange(len(targets)), targets] - lse).tolist()  # finite, even for an id past `sampleable`
    if not k:
        return [(lp, None) for lp in chosen]
    ids, lp = most_likely(emitted, lse, k)
    return [(c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, ids.tolist(), lp.tolist(), strict=True)]


def record(states: list[RequestState], logits: np.ndarray, start: int, sampleable: int) -> None:
    """Append to each asking request's `prompt_logprobs` what its row of a prefill's logits [rows, positions,
    vocab] scores: a whole prompt's (start 0), or a chunk's, the chunks in order."""
    for row, state in enumerate(states):
        if state.prompt_logprobs is not None:
            state.prompt_logprobs += score(logits[row], state.prompt, start, state.request.prompt_logprobs,
                                           sampleable)
