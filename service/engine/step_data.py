"""What flows between the phases of a step (`Engine.step`: schedule -> run -> sample -> update):

    RunnerOutput   run -> sample      one model call: the rows to sample and their logits, the requests it failed
    Sampled        sample -> update   each row's chosen tokens, each beam search's next beams, the faults
    Output         update -> caller   what a step gives a request: a token event, or the error that ended it

A row's logits cover one position (its fed token), or, for a row that fed speculation's drafts after its
token, one position per token fed (`Verification`). Rows are in the model call's order throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.engine.errors import EngineError, ModelError
from service.engine.request import TokenEvent
from service.engine.sequence import RequestState, Sequence

Output = tuple[RequestState, TokenEvent | EngineError]  # what a step gives a request: a token, or its end


@dataclass
class SpeculationPlan:
    """What speculation decided for one decode call, kept so it can measure what the call gave."""

    width: int  # decode rows in the call
    drafts: dict[int, list[int]]  # decode row -> the drafts it checks (empty: a plain decode)
    started: float  # time.perf_counter() when the plan began: the phase's seconds count from here


@dataclass
class Verification:
    """A row that fed drafts after its pending token, in a call of its own."""

    drafts: list[int]  # the draft ids fed after the pending token
    logits: np.ndarray  # [len(drafts) + 1, vocab] the target's logits after the pending token and after each draft


@dataclass
class RunnerOutput:
    """What one model call gave: the rows to sample with their logits, and the requests it failed."""

    seqs: list[Sequence] = field(default_factory=list)  # the rows to sample, in the call's order
    # [rows, vocab] each row's logits at its fed token (None when every row verified drafts)
    logits: np.ndarray | None = None
    # rows that fed drafts too -> every position's logits (their row of `logits` is not read)
    verified: dict[int, Verification] = field(default_factory=dict)
    failed: list[Output] = field(default_factory=list)  # the outputs of the requests the call failed, ended already
    plan: SpeculationPlan | None = None  # a decode call's speculation plan (None: speculation is off, or a prefill)

    def __add__(self, other: RunnerOutput) -> RunnerOutput:
        """Two calls' outputs as one (calls that verified no drafts: the retried parts of a failed call)."""
        assert not self.verified and not other.verified, "verifications are not joined"
        rows = [r.logits for r in (self, other) if r.seqs]
        return RunnerOutput(self.seqs + other.seqs, np.concatenate(rows) if len(rows) == 2 else (rows or [None])[0],
                            failed=self.failed + other.failed)


@dataclass
class BeamChoice:
    """A beam search request's next beams, as its `BeamSearch.step` chose them."""

    state: RequestState  # the request (its search is `done` when this was its last step)
    parents: list[int]  # next beam j continues running beam parents[j] ...
    tokens: list[int]  # ... with tokens[j]


@dataclass
class Drafted:
    """A row that checked drafts: the tokens it takes, in order."""

    seq: Sequence
    tokens: list[int]  # the drafts the target kept, then the target's own token
    logprobs: list[float | None]  # per token, the model's logprob (None: the request asked for none)
    tops: list[list[tuple[int, float]] | None]  # per token, the most likely alternatives (None: not asked for)
    drafts: int  # drafts it checked
    kept: int  # of those, the ones the target kept: tokens[:kept]


@dataclass
class Sampled:
    """What the sample phase chose for one model call's rows, for the output step to apply."""

    seqs: list[Sequence] = field(default_factory=list)  # the rows that take one token each, in the call's order
    tokens: list[int] = field(default_factory=list)  # per row, its token
    logprobs: list[float | None] = field(default_factory=list)  # per row, its logprob (None: not asked for)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)  # per row, its alternatives
    drafted: list[Drafted] = field(default_factory=list)  # the rows that checked drafts
    beams: list[BeamChoice] = field(default_factory=list)  # each beam search request's next beams
    faults: list[tuple[RequestState, ModelError]] = field(default_factory=list)  # requests whose sampling failed
    failed: list[Output] = field(default_factory=list)  # the model call's failed requests' outputs, passed on

    @property
    def chosen(self) -> int:
        """Tokens chosen for the rows (a beam search's are emitted when it ends)."""
        return len(self.tokens) + sum(len(d.tokens) for d in self.drafted)
