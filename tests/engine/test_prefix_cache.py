"""Prefix caching: a prompt that starts with cached blocks reuses their keys and values, and every
output is what the engine gives without the cache (greedy and seeded sampling, n > 1, chunked
suffixes, eviction, requests arriving while others decode)."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.kv_cache import KVCache
from service.engine.prefix_cache import PrefixCache
from service.runtime.static_runner import CacheShape
from tests.engine.harness import check_idle, drive, greedy, random_prompt, sampled

SHAPE = CacheShape(n_layer=2, n_head=2, d_head=4, max_seq=64)
B = 4  # block tokens in the unit tests


def filled_kv(n_slots: int = 2) -> KVCache:
    """A KV cache whose every value says where it is: slot * 1000 + position."""
    kv = KVCache(SHAPE, n_slots)
    for buf in kv.buffers:
        buf[:] = (np.arange(n_slots)[:, None, None, None] * 1000 + np.arange(SHAPE.max_seq)[None, None, :, None])
    return kv


def test_match_finds_whole_blocks_of_the_same_prefix_and_leaves_the_last_token():
    cache, kv = PrefixCache(SHAPE, n_blocks=8, block_tokens=B), filled_kv()
    prompt = list(range(1, 11))  # 10 tokens: two whole blocks and two more
    assert cache.store(prompt, kv, slot=1) == 2
    assert cache.match(prompt).tokens == 8
    assert cache.match(prompt[:9]).tokens == 8
    assert cache.match(prompt[:8]).tokens == 4  # the last token is always computed
    assert cache.match(prompt[:4] + [99] + prompt[5:]).tokens == 4  # one token differs in block 2
    assert cache.match([99] + prompt[1:]).tokens == 0  # a later block never matches without its parent
    assert cache.store(prompt, kv, slot=1) == 0  # already kept


def test_load_copies_the_blocks_keys_and_values_into_the_slot():
    cache, kv = PrefixCache(SHAPE, n_blocks=8, block_tokens=B), filled_kv()
    prompt = list(range(1, 11))
    cache.store(prompt, kv, slot=1)
    for buf in kv.buffers:
        buf[0] = -1
    hit = cache.match(prompt)
    cache.load(hit, kv, slot=0)
    assert kv.lengths[0] == 8
    for buf in kv.buffers:
        np.testing.assert_array_equal(buf[0, :, :8], buf[1, :, :8])  # slot 1's positions 0-7
        assert (buf[0, :, 8:] == -1).all()  # nothing past the hit


def test_eviction_takes_the_least_recently_used_leaf_never_a_block_that_others_extend():
    cache, kv = PrefixCache(SHAPE, n_blocks=3, block_tokens=B), filled_kv()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 0]  # two blocks: a1 -> a2
    b = [9, 9, 9, 9, 0]  # one block
    cache.store(a, kv, 0)
    cache.store(b, kv, 0)
    assert cache.blocks_used == 3
    cache.load(cache.match(a), kv, 1)  # a is now the most recently used
    c = [7, 7, 7, 7, 0]
    cache.store(c, kv, 0)  # evicts b (the least recently used leaf), not a1 nor a2
    assert cache.match(b).tokens == 0 and cache.match(a).tokens == 8 and cache.match(c).tokens == 4
    d = [5, 5, 5, 5, 0]
    cache.store(d, kv, 0)  # the LRU order is a1, a2, c: a1 has a child, so a2 goes
    assert cache.match(a).tokens == 4 and cache.match(c).tokens == 4 and cache.match(d).tokens == 4


def test_a_full_cache_of_one_chain_keeps_it_and_stores_what_fits():
    cache, kv = PrefixCache(SHAPE, n_blocks=2, block_tokens=B), filled_kv()
    long = list(range(1, 20))  # four whole blocks, two fit
    assert cache.store(long, kv, 0) == 2  # the third would have to evict its own parent: it stops there
    assert cache.match(long).tokens == 8 and cache.blocks_used == 2


# ---- the engine: the same outputs with and without the cache --------------------------------------

def run_both(make_engine, arrivals, exact: bool = True, **config):
    """The same arrivals on an engine with the prefix cache and one without: the same tokens, and with
    `exact` the same logprobs to the bit (a hit on blocks that prefill wrote is a miss's cache exactly)."""
    cached = make_engine(**config)
    plain = make_engine(**{**config, "prefix_caching": False})
    with_cache = drive(cached, arrivals={k: list(v) for k, v in arrivals.items()})
    without = drive(plain, arrivals={k: list(v) for k, v in arrivals.items()})
    assert not with_cache.errors and not without.errors
    assert with_cache.events.keys() == without.events.keys()
    for key in without.events:
        got, want = with_cache.events[key], without.events[key]
        assert [e.token_id for e in got] == [e.token_id for e in want], key
        assert [e.finish_reason for e in got] == [e.finish_reason for e in want], key
        if exact:
            assert [e.logprob for e in got] == [e.logprob for e in want], key
        else:
            np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=1e-4)
    check_idle(cached)
    return cached


def shared_prefix_requests(make_request, prefix_len: int, n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    prefix = random_prompt(rng, prefix_len)
    return [make_request(f"r{i}", prefix + random_prompt(rng, int(rng.integers(1, 12)))) for i in range(n)]


def test_greedy_requests_with_a_shared_prefix_equal_the_engine_without_the_cache(make_engine):
    reqs = shared_prefix_requests(lambda rid, p: greedy(rid, p, 12), prefix_len=40, n=6)
    # the first alone, then the rest together and while others decode
    engine = run_both(make_engine, {0: reqs[:1], 14: reqs[1:4], 16: reqs[4:]})
    s = engine.stats()
    assert s.prefix_hit_tokens == 5 * 32  # 40 shared tokens: two whole blocks of 16 for each later prompt
    assert s.prefix_queried_tokens == sum(len(r.prompt_token_ids) for r in reqs)


def test_seeded_sampling_and_n_siblings_equal_the_engine_without_the_cache(make_engine):
    def make(rid, p):
        return sampled(rid, p, 10, seed=len(p), n=2, temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    reqs = shared_prefix_requests(make, prefix_len=35, n=4, seed=1)
    engine = run_both(make_engine, {0: reqs[:1], 12: reqs[1:]})
    assert engine.stats().prefix_hit_tokens == 3 * 32


def test_a_long_suffix_after_a_hit_is_chunked_and_still_equal(make_engine):
    rng = np.random.default_rng(2)
    prefix = random_prompt(rng, 48)
    reqs = [greedy("first", prefix + [5], 6), greedy("long", prefix + random_prompt(rng, 60), 6),
            greedy("other", random_prompt(rng, 30), 20)]
    engine = run_both(make_engine, {0: reqs[:1], 8: reqs[2:], 10: reqs[1:2]}, max_batch_tokens=24)
    assert engine.stats().prefix_hit_tokens == 48


def test_the_next_chat_turn_finds_the_earlier_turn_and_its_reply(make_engine):
    rng = np.random.default_rng(3)
    turn1 = random_prompt(rng, 20)
    first = make_engine()
    reply = drive(first, [greedy("t1", turn1, 30)]).tokens("t1")
    turn2 = turn1 + reply + random_prompt(rng, 5)
    # the reply's blocks were written by decode steps, whose attention rounds otherwise than a prefill's:
    # the same tokens, logprobs within float rounding (docs/api.md, batch invariance)
    engine = run_both(make_engine, {0: [greedy("t1", turn1, 30)], 40: [greedy("t2", turn2, 8)]}, exact=False)
    # turn 1 wrote 20 + 29 positions (its last token is never fed back): three whole blocks
    assert engine.stats().prefix_hit_tokens == 48


def test_a_small_cache_evicts_and_outputs_stay_equal(make_engine):
    rng = np.random.default_rng(4)
    prefixes = [random_prompt(rng, 33) for _ in range(4)]
    arrivals = {3 * i: [greedy(f"r{i}", prefixes[i % 4] + random_prompt(rng, 3), 4)] for i in range(12)}
    engine = run_both(make_engine, arrivals, prefix_cache_tokens=64)  # 4 blocks: two prefixes at most
    assert engine.prefixes.blocks_used <= 4


def test_usage_of_the_cache_is_reported_per_request(make_engine):
    engine = make_engine()
    reqs = shared_prefix_requests(lambda rid, p: greedy(rid, p, 4), prefix_len=20, n=2)
    states = {}
    original = engine.add

    def add(state):
        states[state.id] = state
        original(state)

    engine.add = add
    drive(engine, arrivals={0: reqs[:1], 6: reqs[1:]})
    assert states["r0"].timing().cached_tokens == 0 and states["r1"].timing().cached_tokens == 16


def test_off_keeps_nothing(make_engine):
    engine = make_engine(prefix_caching=False)
    assert engine.prefixes is None
    reqs = shared_prefix_requests(lambda rid, p: greedy(rid, p, 4), prefix_len=40, n=3)
    drive(engine, arrivals={0: reqs[:1], 6: reqs[1:]})
    s = engine.stats()
    assert s.prefix_hit_tokens == 0 and s.prefix_cache_bytes == 0


@pytest.mark.parametrize("tokens", [0, 15])
def test_less_than_a_block_is_off(make_engine, tokens):
    assert make_engine(prefix_cache_tokens=tokens).prefixes is None
