"""The engine's running totals, each counted where it happens, so a snapshot (`Engine.stats()`) reads them in
O(1): tokens generated and their recent rate, steps, requests running, and speculative decoding's drafts.

    counters = EngineCounters()
    counters.count_tokens(n)                    # the output step, as it emits
    counters.tokens_per_s(time.monotonic())     # over the last RATE_WINDOW_S
    counters.speculation()                      # SpeculationStats since start

A draft token is accepted when the target kept it and the sequence emitted it (a stop met before it drops it):
the output step counts it here and on the sequence (`Speculation.accepted`) in one place, so every
sequence's counts add up to the engine's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding since the engine started, as its snapshot carries it (all 0 when it is off)."""

    drafts: int = 0  # drafts the target checked: one per speculating row and step
    draft_tokens: int = 0  # their tokens
    accepted_tokens: int = 0  # of those, the ones the target kept and the sequences emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class EngineCounters:
    """Totals since the engine started (the engine thread alone writes them)."""

    generated_tokens: int = 0  # tokens emitted
    steps: int = 0  # steps that ran model work
    running_requests: int = 0  # requests whose prefill has started and that have not ended
    drafts: int = 0  # drafts the target checked: one per speculating row and step
    draft_tokens: int = 0  # their tokens
    accepted_tokens: int = 0  # of those, the ones the target kept and the sequences emitted
    decode_calls: int = 0  # decode phases speculation decided on (plain or speculating)
    speculating_tokens: int = 0  # tokens the speculating ones of those gave
    _rate: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) of the outputs in the window
    _rate_tokens: int = 0  # their sum

    def count_tokens(self, tokens: int, now: float) -> None:
        self.generated_tokens += tokens
        self._rate.append((now, tokens))
        self._rate_tokens += tokens

    def tokens_per_s(self, now: float) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (amortised O(1))."""
        rate = self._rate
        while rate and rate[0][0] < now - RATE_WINDOW_S:
            self._rate_tokens -= rate.popleft()[1]
        return self._rate_tokens / max(now - rate[0][0], 1e-3) if rate else 0.0

    def speculation(self) -> SpeculationStats:
        return SpeculationStats(self.drafts, self.draft_tokens, self.accepted_tokens)
