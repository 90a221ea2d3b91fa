"""Requests that end early: aborted, expired, refused, or hit by a fault in a model call or in choosing their tokens.

Each frees its KV slots in the step it ends, and the other requests' tokens are unchanged.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from service.engine.errors import Cancelled, DeadlineExceeded, InvalidRequest, ModelError
from service.engine.request import Constraint, GenerationRequest, SamplingParams, StoppingCriteria
from tests.engine.harness import (
    Run,
    beam,
    check_idle,
    drive,
    eager_speculation,
    greedy,
    random_prompt,
    run_alone,
    sampled,
)


def workload(rng_seed: int = 0) -> list[GenerationRequest]:
    rng = np.random.default_rng(rng_seed)
    return [greedy("a", random_prompt(rng, 9), 30, ignore_eos=True),
            sampled("b", random_prompt(rng, 14), 30, seed=1, n=2, temperature=0.8, stopping=dict(ignore_eos=True)),
            sampled("c", random_prompt(rng, 5), 25, seed=2, temperature=0.8, top_k=40),
            greedy("d", random_prompt(rng, 21), 28)]


def slots_of(engine, rid: str) -> int:
    return sum(1 for o in engine.kv.owners[:engine.kv.used] if o is not None and o.request_state.id == rid)


# ---- abort ---------------------------------------------------------------------------------------

def test_abort_mid_generation_frees_slots_and_leaves_the_others_unchanged(make_engine):
    without_b = drive(make_engine(), [r for r in workload() if r.request_id != "b"])
    engine = make_engine()
    run = Run()
    for r in workload():
        engine.add(engine.new_request(r))
    for _ in range(6):
        run.collect(engine.step())
    assert slots_of(engine, "b") == 2 and len(run.events[("b", 0)]) > 0
    used, free, stats = engine.kv.used, engine.kv.free_slots, engine.stats()

    out = engine.abort("b")

    assert len(out) == 1 and out[0][0].id == "b" and isinstance(out[0][1], Cancelled)
    assert engine.kv.used == used - 2 and engine.kv.free_slots == free + 2  # at once, not at the next step
    assert slots_of(engine, "b") == 0
    after = engine.stats()
    assert after.kv_free_slots == stats.kv_free_slots + 2
    assert after.running_sequences == stats.running_sequences - 2
    assert after.running_requests == stats.running_requests - 1
    assert "b" not in engine.requests
    assert engine.abort("b") == []  # already gone: nothing more to report
    assert engine.abort("nobody") == []
    run.collect(out)
    engine.generate(on_outputs=run.collect)
    check_idle(engine)

    assert isinstance(run.errors["b"], Cancelled) and set(run.errors) == {"b"}
    assert all(e.finish_reason is None for i in (0, 1) for e in run.events[("b", i)])  # cut short
    for rid in "acd":
        assert run.tokens(rid) == without_b.tokens(rid), rid
        assert run.text(rid) == without_b.text(rid)
        assert run.finish(rid) == without_b.finish(rid)


def test_abort_a_waiting_request(make_engine):
    engine = make_engine(max_running=2, max_batch_tokens=64)
    reqs = workload()
    run = Run()
    for r in reqs:
        engine.add(engine.new_request(r))
    run.collect(engine.step())  # a and b (n=2) would need 3 slots: only a is admitted
    waiting_ids = [s.id for s in engine.scheduler.waiting]
    assert "c" in waiting_ids
    out = engine.abort("c")
    assert [(s.id, type(e)) for s, e in out] == [("c", Cancelled)]
    assert "c" not in [s.id for s in engine.scheduler.waiting] and engine.stats().waiting_requests == len(waiting_ids) - 1
    engine.generate(on_outputs=run.collect)
    check_idle(engine)
    assert ("c", 0) not in run.events
    want = drive(make_engine(max_running=2, max_batch_tokens=64), [r for r in workload() if r.request_id != "c"])
    for rid, index in want.events:
        assert run.tokens(rid, index) == want.tokens(rid, index)


def test_abort_during_chunked_prefill(make_engine):
    rng = np.random.default_rng(1)
    engine = make_engine(max_running=4, max_batch_tokens=20)
    short = greedy("short", random_prompt(rng, 6), 30)
    long = greedy("long", random_prompt(rng, 90), 10)
    later = greedy("later", random_prompt(rng, 12), 12)

    def abort_long(e, step, r):
        if step == 4:
            assert e.scheduler.chunking is not None and e.scheduler.chunking.request_state.id == "long"
            assert 0 < e.scheduler.chunking.num_prefilled < 90
            r.collect(e.abort("long"))
            assert e.scheduler.chunking is None and e.kv.used == 1

    run = drive(engine, [short], arrivals={2: [long], 5: [later]}, before_step=abort_long)
    assert isinstance(run.errors["long"], Cancelled) and ("long", 0) not in run.events
    assert run.tokens("short") == run_alone(make_engine, greedy("short", short.prompt_token_ids, 30)).tokens("short")
    assert run.tokens("later") == run_alone(make_engine, greedy("later", later.prompt_token_ids, 12)).tokens("later")


def test_abort_while_the_prompt_is_being_chunked_frees_its_slot(make_engine):
    engine = make_engine(max_running=4, max_batch_tokens=20)
    engine.add(engine.new_request(greedy("long", list(range(1, 91)), 10)))
    engine.step()
    assert engine.scheduler.chunking is not None and engine.kv.used == 1
    engine.abort("long")
    check_idle(engine)


# ---- deadlines -----------------------------------------------------------------------------------

def test_past_deadline_expires_a_waiting_request(make_engine):
    engine = make_engine()
    r = greedy("late", [5, 6, 7], 10)
    r.deadline = time.monotonic() - 1
    engine.add(engine.new_request(r))
    engine.add(engine.new_request(greedy("ok", [5, 6, 7], 10)))
    out = engine.expire()
    assert [(s.id, type(e)) for s, e in out] == [("late", DeadlineExceeded)]
    assert "queue" in str(out[0][1])
    assert [s.id for s in engine.scheduler.waiting] == ["ok"]
    run = drive(engine)
    assert run.tokens("ok") == run_alone(make_engine, greedy("ok", [5, 6, 7], 10)).tokens("ok")


def test_deadline_expires_a_running_request_and_frees_its_slots(make_engine):
    engine = make_engine()
    reqs = workload()
    soon = time.monotonic() + 1000
    reqs[1].deadline = soon  # b, n=2
    run = Run()
    for r in reqs:
        engine.add(engine.new_request(r))
    for _ in range(4):
        run.collect(engine.step())
        run.collect(engine.expire())  # not yet
    assert not run.errors and slots_of(engine, "b") == 2
    free = engine.kv.free_slots
    out = engine.expire(now=soon + 1)
    assert [(s.id, type(e)) for s, e in out] == [("b", DeadlineExceeded)]
    assert "running" in str(out[0][1])
    assert engine.kv.free_slots == free + 2 and slots_of(engine, "b") == 0
    engine.generate(on_outputs=run.collect)
    check_idle(engine)
    want = drive(make_engine(), [r for r in workload() if r.request_id != "b"])
    for rid in "acd":
        assert run.tokens(rid) == want.tokens(rid)


def test_deadline_exactly_now_expires_and_a_future_one_does_not(make_engine):
    engine = make_engine()
    a, b = greedy("a", [1, 2], 5), greedy("b", [1, 2], 5)
    a.deadline, b.deadline = 100.0, 100.5
    engine.add(engine.new_request(a))
    engine.add(engine.new_request(b))
    assert [s.id for s, _ in engine.expire(now=100.0)] == ["a"]
    assert engine.expire(now=100.4) == []
    assert [s.id for s, _ in engine.expire(now=101.0)] == ["b"]
    check_idle(engine)


# ---- request ids ---------------------------------------------------------------------------------

def test_duplicate_request_id_is_refused_while_running(make_engine):
    engine = make_engine()
    engine.add(engine.new_request(greedy("same", [1, 2, 3], 4)))
    with pytest.raises(InvalidRequest) as e:
        engine.add(engine.new_request(greedy("same", [4, 5], 4)))
    assert e.value.field == "request_id"
    run = drive(engine)
    assert len(run.tokens("same")) == 4 and not run.errors
    engine.add(engine.new_request(greedy("same", [4, 5], 4)))  # finished ids may be reused
    assert len(drive(engine).tokens("same")) == 4


# ---- model faults --------------------------------------------------------------------------------

def test_model_fault_fails_that_step_only(make_engine):
    engine = make_engine(max_running=3, max_batch_tokens=40)
    reqs = workload()  # a, b (n=2) fill the 3 slots; c, d wait
    original = engine.runner.decode
    calls = {"n": 0}

    def flaky(ids, positions):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return original(ids, positions)

    engine.runner.decode = flaky
    run = Run()
    for r in reqs:
        engine.add(engine.new_request(r))
    while calls["n"] < 3:
        in_step = {s.request_state.id for s in engine.kv.owners[:engine.kv.used] if s is not None}
        waiting = [s.id for s in engine.scheduler.waiting]
        run.collect(engine.step())
    assert in_step == {"a", "b"} and waiting == ["c", "d"]
    assert {rid: type(e) for rid, e in run.errors.items()} == {"a": ModelError, "b": ModelError}
    assert "injected fault" in run.errors["a"].detail and "injected" not in str(run.errors["a"])  # the log's, not the client's
    assert engine.kv.used == 0 and engine.kv.reserved == 0  # freed in the failing step
    assert [s.id for s in engine.scheduler.waiting] == ["c", "d"]
    engine.generate(on_outputs=run.collect)
    check_idle(engine)
    engine.add(engine.new_request(greedy("e", [9, 8, 7, 6], 12)))
    after = drive(engine)
    want = drive(make_engine(max_running=3, max_batch_tokens=40), [r for r in workload() if r.request_id in "cd"])
    for rid in "cd":
        assert run.tokens(rid) == want.tokens(rid) and run.finish(rid) is not None
    assert after.tokens("e") == run_alone(make_engine, greedy("e", [9, 8, 7, 6], 12)).tokens("e")


def test_model_fault_in_prefill_fails_the_admitted_requests_and_releases_reservations(make_engine):
    engine = make_engine(max_running=8, max_batch_tokens=40)
    original = engine.runner.prefill_batch
    engine.runner.prefill_batch = lambda *a: (_ for _ in ()).throw(RuntimeError("prefill fault"))
    reqs = [sampled("fam", [3, 4, 5], 6, seed=1, n=3, temperature=0.5), greedy("solo", [7, 8], 6)]
    run = Run()
    for r in reqs:
        engine.add(engine.new_request(r))
    run.collect(engine.step())
    assert {rid: type(e) for rid, e in run.errors.items()} == {"fam": ModelError, "solo": ModelError}
    check_idle(engine)
    engine.runner.prefill_batch = original
    again = drive(engine, [sampled("fam", [3, 4, 5], 6, seed=1, n=3, temperature=0.5)])
    want = run_alone(make_engine, sampled("fam", [3, 4, 5], 6, seed=1, n=3, temperature=0.5))
    assert [again.tokens("fam", i) for i in range(3)] == [want.tokens("fam", i) for i in range(3)]


POISON = 299  # a token id the injected fault recognises; random prompts below stay under it


def poisoned_prefill(engine) -> None:
    """Make every prefill whose prompts include POISON raise, as a kernel failing on one input would."""
    original = engine.runner.prefill_batch

    def prefill_batch(first_slot, prompts, *args, **kwargs):
        if any(POISON in p for p in prompts):
            raise RuntimeError("injected prefill fault")
        return original(first_slot, prompts, *args, **kwargs)

    engine.runner.prefill_batch = prefill_batch


def test_a_prompt_whose_prefill_raises_fails_alone_while_eight_streams_decode(make_engine):
    """One bad prompt never ends the other streams: the 8 decoding streams, and a good prompt admitted
    in the same step as the bad one, complete with exactly the tokens they produce alone."""
    rng = np.random.default_rng(5)
    streams = [sampled(f"s{i}", random_prompt(rng, 4 + i, vocab=POISON), 24, seed=i, temperature=0.8,
                       stopping=dict(ignore_eos=True)) for i in range(8)]
    bad = greedy("bad", [5, POISON, 7], 8)
    neighbour = greedy("neighbour", random_prompt(rng, 6, vocab=POISON), 8, ignore_eos=True)
    engine = make_engine(max_running=10, max_batch_tokens=128)
    poisoned_prefill(engine)
    run = drive(engine, streams, arrivals={3: [bad, neighbour]})
    assert {rid: type(e) for rid, e in run.errors.items()} == {"bad": ModelError}
    assert "injected prefill fault" in run.errors["bad"].detail and not run.events[("bad", 0)]
    for r in streams + [neighbour]:
        alone = run_alone(make_engine, r, max_running=10, max_batch_tokens=128)
        assert run.tokens(r.request_id) == alone.tokens(r.request_id), r.request_id
        assert run.finish(r.request_id) == alone.finish(r.request_id)


def test_generate_runs_requests_to_the_end_and_returns_them_in_order(make_engine):
    engine = make_engine()
    late = greedy("late", [1, 2, 3], 4)
    late.deadline = time.monotonic() - 1
    seen = []
    done = engine.generate([greedy("a", [1, 2, 3], 5, ignore_eos=True), late, greedy("b", [4, 5], 3, ignore_eos=True)],
                           on_outputs=seen.extend)
    assert [d.request_id for d in done] == ["a", "late", "b"]
    assert len(done[0].token_ids()) == 5 and len(done[2].token_ids()) == 3 and done[0].error is None
    assert isinstance(done[1].error, DeadlineExceeded) and not done[1].events
    assert len(seen) == 5 + 3 + 1  # every output, the error included
    assert done[0].token_ids() == drive(make_engine(), [greedy("a", [1, 2, 3], 5, ignore_eos=True)]).tokens("a")
    check_idle(engine)


# ---- a fault in one request's sample phase -------------------------------------------------------


class Faulty:
    """Stands in for `target`, passing every attribute through, except that reading `name` raises from its
    `after + 1`-th time on: a bug that strikes one request's sampling part-way through."""

    def __init__(self, target, name: str, after: int):
        self._target, self._name, self._after, self._reads = target, name, after, 0

    def __getattr__(self, attr: str):
        if attr == self._name:
            self._reads += 1
            if self._reads > self._after:
                raise RuntimeError("injected sampling fault")
        return getattr(self._target, attr)


def neighbours(rng: np.random.Generator) -> list[GenerationRequest]:
    """Requests of every kind that must finish as they do alone: greedy, seeded sampled (penalised too, so it
    shares the sampler's penalty pass with the faulty row), a beam search, and a constrained one."""
    regex = Constraint("regex", "[a-z ]{4,30}")
    return [greedy("g", random_prompt(rng, 7), 14, ignore_eos=True),
            sampled("s", random_prompt(rng, 5), 14, seed=3, temperature=0.9, stopping=dict(ignore_eos=True)),
            sampled("p", random_prompt(rng, 6), 14, seed=4, temperature=0.9, frequency_penalty=0.5,
                    stopping=dict(ignore_eos=True)),
            beam("b", random_prompt(rng, 6), width=3, n=2, max_new=10),
            GenerationRequest("c", random_prompt(rng, 4), SamplingParams(seed=5), StoppingCriteria(max_new_tokens=14),
                              constraint=regex, logprobs=True)]


def faulty(kind: str, engine, rng: np.random.Generator):
    """A request whose sampling fails at its third step: its beam search's step, its penalties' parameters, or
    its grammar's mask."""
    if kind == "beam":
        state = engine.new_request(beam("bad", random_prompt(rng, 5), width=2, n=1, max_new=10))
        state.beam = Faulty(state.beam, "step", 2)
    elif kind == "penalty":
        state = engine.new_request(sampled("bad", (random_prompt(rng, 4) * 6)[:20], 14, seed=9, temperature=0.9,
                                           repetition_penalty=1.2, stopping=dict(ignore_eos=True)))
        state.seqs[0].sampling.params = Faulty(state.seqs[0].sampling.params, "repetition_penalty", 2)
    else:
        state = engine.new_request(GenerationRequest("bad", random_prompt(rng, 5), SamplingParams(seed=8),
                                                     StoppingCriteria(max_new_tokens=14),
                                                     constraint=Constraint("regex", "[a-z]{4,30}")))
        state.seqs[0].matcher = Faulty(state.seqs[0].matcher, "unsafe_compute_mask_ptr", 2)
    return state


def _made(run: Run, rid: str, index: int) -> list[tuple]:
    return [(e.token_id, e.logprob, e.text, e.finish_reason, e.beam_score) for e in run.events[(rid, index)]]


@pytest.mark.parametrize(("kind", "speculative"), [("beam", False), ("penalty", False), ("grammar", False),
                                                   ("penalty", True)])
def test_a_fault_in_one_requests_sampling_fails_that_request_alone(make_engine, kind, speculative):
    """The faulty request ends with ModelError in the step its sampling fails; the requests decoding beside it
    (in the same batch of the sampler, and the same model call) finish with exactly the events they give alone."""
    config = dict(speculative="ngram", speculative_tokens=3) if speculative else {}

    def engine_of():
        engine = make_engine(**config)
        if speculative:
            eager_speculation(engine)
            engine.warm_up()
        return engine
    engine = engine_of()
    try:
        engine.grammars.tokenizer()
    except InvalidRequest:
        pytest.skip("this bundle's tokenizer cannot be read by llguidance")
    rng = np.random.default_rng(11)
    state = faulty(kind, engine, rng)
    others = neighbours(rng)
    engine.add(state)
    run = drive(engine, others)
    assert {rid: type(e) for rid, e in run.errors.items()} == {"bad": ModelError}
    assert "injected sampling fault" in run.errors["bad"].detail
    assert all(e.finish_reason is None for events in [run.events[("bad", 0)]] for e in events)
    for r in others:
        alone = drive(engine_of(), [r])
        for index in range(r.n):
            assert _made(run, r.request_id, index) == _made(alone, r.request_id, index), (r.request_id, index)
