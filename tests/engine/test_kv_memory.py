"""KV memory in blocks: sequences take blocks as they write, the prefix cache lives in what they leave free,
and a sequence that cannot grow preempts the newest one, which is recomputed later and finishes with the text
it gives alone."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from service.engine.config import EngineConfig
from service.engine.errors import InvalidRequest
from tests.engine.harness import drive, greedy, random_prompt, run_alone, sampled


def check_blocks(engine) -> None:
    """No more blocks are held than the budget has, and every row holds the blocks of what it wrote."""
    kv = engine.kv
    assert kv.held_total + kv.promised + kv.shared() <= kv.n_blocks
    for slot in range(kv.used):
        assert kv.held[slot] * kv.block_tokens >= kv.lengths[slot]


def small_cache(make_engine, contexts: float, **config):
    per_slot = make_engine(max_running=1, prefix_caching=False).kv.shape.bytes_per_slot
    return make_engine(kv_cache_bytes=int(contexts * per_slot), **config)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_requests_finish_with_the_text_they_give_alone(make_engine, engine_model, prefix_caching):
    rng = np.random.default_rng(3)
    reqs = [greedy(f"r{i}", random_prompt(rng, 40), engine_model.n_ctx - 48, ignore_eos=True) for i in range(5)]
    engine = small_cache(make_engine, 2.5, max_running=8, prefix_caching=prefix_caching)
    assert engine.kv.n_blocks * engine.kv.block_tokens < 5 * (engine_model.n_ctx - 8) * 0.6  # about half of them
    run = drive(engine, reqs, before_step=lambda e, step, run: check_blocks(e))
    assert not run.errors and engine.stats().preemptions > 0
    for r in reqs:
        alone = run_alone(make_engine, r)
        assert run.tokens(r.request_id) == alone.tokens(r.request_id)
        logprobs = [[e.logprob for e in r_.events[(r.request_id, 0)]] for r_ in (run, alone)]
        np.testing.assert_allclose(*logprobs, atol=1e-4)
    assert engine.kv.held_total == 0 and engine.kv.used == 0


def test_sampled_and_forked_requests_beside_preemption(make_engine, engine_model):
    """n > 1 requests hold their whole completion from admission and are never preempted; a seeded sampled one
    that is preempted keeps its distribution's draws (its seed decides each token, as alone)."""
    rng = np.random.default_rng(5)
    reqs = [sampled("fam", random_prompt(rng, 20), 40, seed=1, n=2, temperature=0.8, stopping=dict(ignore_eos=True))]
    # four sequences of nearly a context each, beside the family's 120 positions, in a cache of three contexts
    reqs += [sampled(f"s{i}", random_prompt(rng, 30), engine_model.n_ctx - 58, seed=i, temperature=0.9,
                     stopping=dict(ignore_eos=True)) for i in range(4)]
    engine = small_cache(make_engine, 3, max_running=8, prefix_caching=False)
    run = drive(engine, reqs, before_step=lambda e, step, run: check_blocks(e))
    assert not run.errors and engine.stats().preemptions > 0
    for r in reqs:
        alone = run_alone(make_engine, r)
        for i in range(r.n):
            assert run.tokens(r.request_id, i) == alone.tokens(r.request_id, i)


def test_the_prefix_cache_gives_its_blocks_back_to_sequences(make_engine, engine_model):
    rng = np.random.default_rng(7)
    engine = small_cache(make_engine, 2, max_running=4)
    for i in range(4):  # each leaves its prompt's blocks in the prefix cache
        run = drive(engine, [greedy(f"p{i}", random_prompt(rng, 100), 4)])
        assert not run.errors
    kept = engine.prefixes.blocks_used
    assert kept > engine.kv.n_blocks // 2 and engine.kv.free_blocks == engine.kv.n_blocks - kept
    long = greedy("long", random_prompt(rng, 60), engine_model.n_ctx - 61, ignore_eos=True)
    other = greedy("other", random_prompt(rng, 60), engine_model.n_ctx - 61, ignore_eos=True)
    run = drive(engine, [long, other], before_step=lambda e, step, run: check_blocks(e))
    assert not run.errors and engine.stats().preemptions == 0
    assert engine.prefixes.blocks_used < kept  # blocks went back to the sequences, least recently used first


def test_a_request_the_cache_could_never_hold_is_refused_at_once(make_engine, engine_model):
    engine = small_cache(make_engine, 2, max_running=8)
    prompt = list(range(1, 11))
    engine.new_request(greedy("fits", prompt, engine_model.n_ctx - 20))  # one sequence always fits, alone
    with pytest.raises(InvalidRequest, match=r"^n: .* positions of KV cache; the server holds"):
        engine.new_request(sampled("many", prompt, engine_model.n_ctx - 20, n=4, temperature=1.0))


def test_memory_budget_reads_a_fraction_or_a_size():
    assert EngineConfig(memory_budget="0.5").memory_budget == "0.5"
    assert EngineConfig(memory_budget=0.25).memory_budget == "0.25"
    assert EngineConfig(memory_budget="12GiB").memory_budget == "12GiB"
    for bad in ("0", "1.5x", "-1", "12 parsecs"):
        with pytest.raises(ValidationError, match="memory_budget"):
            EngineConfig(memory_budget=bad)


def test_a_budget_too_small_for_one_sequence_names_the_settings_that_fix_it(make_engine):
    with pytest.raises(ValueError, match=r"cannot hold one sequence .*--max-context; \d+ positions fit.*"
                                         r"--memory-budget"):
        make_engine(memory_budget="1MiB")
