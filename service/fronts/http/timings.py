"""A response's `timings`, in llama.cpp's server's shape: how long the prompt and the generation took, and
how many tokens each phase computed.

    timings(request_timings, last_token_at, prompt_tokens, completion_tokens, drafts)
    -> {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
        "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
        "draft_n", "draft_n_accepted" (with speculative decoding only)}

The prompt phase runs from the start of the first prefill to the last first token (a request with several
prompts prefills each), the generation from the first token to the last; `prompt_n` counts the prompt tokens
computed (those the prefix cache did not supply, which are `cache_n`), `predicted_n` the completion tokens.
The times come from the engine's own clock (`Timing`, `TokenEvent.time`); a rate over no time is 0.
"""

from __future__ import annotations

from typing import Any

from service.engine.sequence import Timing
from service.fronts.draft_counts import DraftCounts


def timings(request_timings: list[Timing], last_token_at: float | None, prompt_tokens: int,
            completion_tokens: int, drafts: DraftCounts) -> dict[str, Any]:
    """The timings of one call's requests (their `Timing` as of their last events), `last_token_at` the time of
    its last token (None before any), its prompt tokens over every prompt and its completion tokens."""
    cached = sum(t.cached_tokens for t in request_timings)
    firsts = [t.first_token_at for t in request_timings if t.first_token_at is not None]
    prompt_s = predicted_s = 0.0
    if firsts and last_token_at is not None:
        started = min(t.scheduled_at if t.scheduled_at is not None else t.arrival for t in request_timings)
        prompt_s, predicted_s = max(firsts) - started, last_token_at - min(firsts)
    out = {"cache_n": cached, **_phase("prompt", prompt_tokens - cached, prompt_s),
           **_phase("predicted", completion_tokens, predicted_s)}
    if drafts.proposed:
        out.update(draft_n=drafts.proposed, draft_n_accepted=drafts.accepted)
    return out


def _phase(name: str, tokens: int, seconds: float) -> dict[str, Any]:
    ms = max(0.0, 1000 * seconds)
    return {f"{name}_n": tokens, f"{name}_ms": ms, f"{name}_per_token_ms": ms / tokens if tokens else 0.0,
            f"{name}_per_second": 1000 * tokens / ms if ms else 0.0}
