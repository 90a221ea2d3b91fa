"""Request priority: the waiting queue admits by priority (lower first), then arrival; a running request is
never preempted for a more urgent one; under memory pressure the least urgent running request is preempted
first, and goes back to the queue with its priority and arrival; the range is checked by name."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import PRIORITY_RANGE, GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.sequence import RequestState
from service.engine.waiting_queue import WaitingQueue
from tests.engine.harness import check_idle, drive, random_prompt, run_alone
from tests.engine.test_kv_memory import small_cache


def request(rid: str, prompt: list[int], priority: int, max_new: int = 8) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=0.0),
                             StoppingCriteria(max_new_tokens=max_new, ignore_eos=True), priority=priority)


def state(rid: str, priority: int) -> RequestState:
    return RequestState(request(rid, [1, 2], priority), seed=0)


def test_the_queue_orders_by_priority_then_arrival_and_a_requeued_request_keeps_its_place():
    queue = WaitingQueue()
    states = {rid: state(rid, p) for rid, p in [("a10", 10), ("b0", 0), ("c10", 10), ("d-3", -3), ("e0", 0)]}
    for s in states.values():
        queue.add(s)
    assert [s.id for s in queue] == ["d-3", "b0", "e0", "a10", "c10"]
    first = queue.popleft()
    assert first.id == "d-3" and len(queue) == 4
    queue.remove(states["a10"])
    queue.add(states["a10"])  # back (as after a preemption): ahead of c10, which arrived after it
    queue.add(first)
    assert [s.id for s in queue] == ["d-3", "b0", "e0", "a10", "c10"]
    assert queue[0] is first


def test_a_full_queue_admits_by_priority_then_arrival_and_never_preempts_the_running(make_engine):
    engine = make_engine(max_running=1)
    rng = np.random.default_rng(21)
    states = {}

    def add(rid: str, priority: int) -> None:
        states[rid] = engine.new_request(request(rid, random_prompt(rng, 4), priority, 6))
        engine.add(states[rid])

    add("running", 10)
    engine.step()  # admitted: it holds the one slot
    for rid, priority in [("b10", 10), ("c10", 10), ("d0", 0), ("e0", 0), ("f-1", -1), ("g10", 10)]:
        add(rid, priority)
    assert [s.id for s in engine.scheduler.waiting] == ["f-1", "d0", "e0", "b10", "c10", "g10"]
    order = []
    while engine.has_work:
        for s in engine.scheduler.waiting:
            assert s.scheduled_at is None
        engine.step()
        order += [rid for rid, s in states.items() if s.scheduled_at is not None and rid not in order]
        assert states["running"].admitted == 0  # the urgent ones waited for it: it was never preempted
    check_idle(engine)
    assert order == ["running", "f-1", "d0", "e0", "b10", "c10", "g10"]
    assert engine.stats().preemptions == 0


def test_memory_pressure_preempts_the_least_urgent_first_and_it_finishes_as_alone(make_engine, engine_model):
    """Three requests nearly a context long each, in a cache of 2.5 contexts: one must give way. The least urgent
    did, though it was admitted first (the newest would have, were they equally urgent); the others were not
    preempted."""
    rng = np.random.default_rng(22)
    max_new = engine_model.n_ctx - 48
    low = request("low", random_prompt(rng, 40), 10, max_new)
    urgent = [request(f"hi{i}", random_prompt(rng, 40), 0, max_new) for i in (1, 2)]
    engine = small_cache(make_engine, 2.5, max_running=8, prefix_caching=False)
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda s: (preempted.append(s.id), preempt(s))[1]
    run = drive(engine, [low], arrivals={1: urgent})  # low is admitted in step 0, the others in step 1
    assert not run.errors and preempted
    assert set(preempted) == {"low"}
    reqs = [low, *urgent]
    for r in reqs:
        assert run.tokens(r.request_id) == run_alone(make_engine, r).tokens(r.request_id)


@pytest.mark.parametrize("priority", [PRIORITY_RANGE[0] - 1, PRIORITY_RANGE[1] + 1, 1.5, True])
def test_a_priority_outside_its_range_is_refused_by_name(make_engine, priority):
    with pytest.raises(InvalidRequest) as e:
        make_engine().new_request(request("p", [1, 2, 3], priority))
    assert e.value.field == "priority" and f"[{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]" in str(e.value)


def test_the_extremes_of_the_range_are_accepted(make_engine):
    engine = make_engine()
    run = drive(engine, [request("lo", [1, 2, 3], PRIORITY_RANGE[0], 3), request("hi", [4, 5], PRIORITY_RANGE[1], 3)])
    assert not run.errors and len(run.tokens("lo")) == len(run.tokens("hi")) == 3
