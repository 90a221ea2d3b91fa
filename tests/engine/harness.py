"""Driving the engine in tests: building requests, stepping a sync engine until it is idle, checking
that nothing is left behind, and holding the engine thread at a known point.

The engine fixtures (`engine_bundle`, `make_engine`) are in tests/conftest.py."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from service.engine.core import Engine
from service.engine.errors import EngineError
from service.engine.request import BeamParams, GenerationRequest, SamplingParams, StoppingCriteria, TokenEvent

# ---- building requests ---------------------------------------------------------------------------

def greedy(rid: str, prompt: list[int], max_new: int = 16, **stopping) -> GenerationRequest:
    """A greedy request that reports logprobs (so equivalence checks compare them too)."""
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=0.0),
                             StoppingCriteria(max_new_tokens=max_new, **stopping), logprobs=True)


def sampled(rid: str, prompt: list[int], max_new: int = 16, seed: int = 0, n: int = 1,
            stopping: dict | None = None, **sampling) -> GenerationRequest:
    """A seeded sampling request that reports logprobs."""
    return GenerationRequest(rid, list(prompt), SamplingParams(seed=seed, **sampling),
                             StoppingCriteria(max_new_tokens=max_new, **(stopping or {})), n=n, logprobs=True)


def beam(rid: str, prompt: list[int], width: int = 3, n: int = 2, max_new: int = 12) -> GenerationRequest:
    """A beam search request: the `n` best of `width` beams."""
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=max_new),
                             n=n, beam=BeamParams(width))


def random_prompt(rng: np.random.Generator, length: int, vocab: int = 300) -> list[int]:
    """Ids from 1 (EOS is 0) up to the vocabulary."""
    return rng.integers(1, vocab, length).tolist()


# ---- driving the sync engine ---------------------------------------------------------------------

@dataclass
class Run:
    """What a run produced: events per (request, sequence index), and the error of each failed request."""

    events: dict[tuple[str, int], list[TokenEvent]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, EngineError] = field(default_factory=dict)
    steps: int = 0

    def tokens(self, rid: str, index: int = 0) -> list[int]:
        return [e.token_id for e in self.events[(rid, index)]]

    def text(self, rid: str, index: int = 0) -> str:
        return "".join(e.text for e in self.events[(rid, index)])

    def finish(self, rid: str, index: int = 0):
        evs = self.events[(rid, index)]
        return evs[-1].finish_reason if evs else None

    def collect(self, outputs: Iterable) -> None:
        for state, item in outputs:
            if isinstance(item, TokenEvent):
                assert item.request_id == state.id
                self.events[(item.request_id, item.index)].append(item)
            else:
                assert isinstance(item, EngineError), item
                assert state.id not in self.errors, f"two errors for {state.id}"
                self.errors[state.id] = item


def drive(engine: Engine, requests: Iterable[GenerationRequest] = (), arrivals: dict[int, list] | None = None,
          before_step: Callable[[Engine, int, Run], None] | None = None, max_steps: int = 5000) -> Run:
    """Add `requests` now and `arrivals[step]` before that step; step until the engine is idle. Without
    arrivals or a hook, this is `Engine.generate`."""
    run = Run()
    if not arrivals and before_step is None:
        start = engine.counters.steps
        engine.generate(requests, on_outputs=run.collect)
        run.steps = engine.counters.steps - start
        check_idle(engine)
        return run
    for r in requests:
        engine.add(engine.new_request(r))
    arrivals = dict(arrivals or {})
    step = 0
    while engine.has_work or any(s >= step for s in arrivals):
        for r in arrivals.pop(step, []):
            engine.add(engine.new_request(r))
        if before_step is not None:
            before_step(engine, step, run)
        run.collect(engine.step())
        step += 1
        assert step < max_steps, "the engine did not finish"
    run.steps = step
    check_idle(engine)
    return run


def check_idle(engine: Engine) -> None:
    """Nothing is left behind: every KV slot and reservation is back, no request or queue entry remains."""
    assert not engine.requests
    assert engine.kv.used == 0 and engine.kv.reserved == 0
    assert engine.kv.free_slots == engine.kv.n_slots
    assert all(o is None for o in engine.kv.owners)
    assert not engine.scheduler.waiting and engine.scheduler.chunking is None


def run_alone(make_engine, request: GenerationRequest, **config) -> Run:
    """`request` on a fresh engine of its own."""
    return drive(make_engine(**config), [request])


def eager_speculation(engine: Engine) -> None:
    """Before `engine` (speculation on) warms up: it will speculate whenever a row has drafts. Its calibration
    finds verifications that cost nothing, and the rates it measures never hold it back (on a tiny model a call
    costs its fixed overhead, and the policy would rarely find speculating worth it)."""
    spec = engine.speculation
    calibrate = spec.calibrate

    def free_verifications() -> None:
        calibrate()
        spec.verify_seconds[1:] = 1e-9

    spec.calibrate = free_verifications
    spec.measure_rates = False


def check_event_stream(run: Run, rid: str, index: int = 0) -> None:
    """Structural invariants of one sequence's events: exactly the last carries finish_reason."""
    evs = run.events[(rid, index)]
    assert evs, f"no events for {rid}/{index}"
    assert all(e.finish_reason is None for e in evs[:-1])
    assert evs[-1].finish_reason is not None


# ---- holding the engine thread at a known point --------------------------------------------------

TIMEOUT = 20.0


class Gate:
    """Holds the engine thread inside its `at`-th decode call (counting only the calls whose input
    ids satisfy `when`, if given) until released."""

    def __init__(self, engine, at: int, when: Callable[[np.ndarray], bool] | None = None):
        self.reached, self.opened = threading.Event(), threading.Event()
        self.calls = 0
        original = engine.runner.decode

        def decode(ids, positions):
            if when is None or when(ids):
                self.calls += 1
                if self.calls == at:
                    self.reached.set()
                    self.opened.wait(TIMEOUT)
            return original(ids, positions)

        engine.runner.decode = decode

    def wait_reached_sync(self) -> None:
        assert self.reached.wait(TIMEOUT), "the engine never reached the gate"

    async def wait_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, TIMEOUT), "the engine never reached the gate"

    def open(self) -> None:
        self.opened.set()
