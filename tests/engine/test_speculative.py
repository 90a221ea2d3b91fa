"""Speculative decoding: the proposer, the acceptance rule, and the engine's output with speculation on
against the same engine with it off (the same tokens and logprobs, greedy; the same distribution, sampled)."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
import pytest

from service.engine.async_engine import AsyncEngine
from service.engine.counters import SpeculationStats
from service.engine.request import Constraint, GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.sampler import SequenceSampling
from service.engine.speculative import NgramIndex, Speculation, accept, expected_tokens
from tests.engine.harness import beam, drive, eager_speculation, greedy, random_prompt, sampled

# ---- the proposer and the rule ---------------------------------------------------------------------------


def lookup(history: list[int], k: int, grown: bool = False) -> list[int]:
    index = NgramIndex(max_ngram=3)
    if grown:  # the history arriving token by token, as a sequence's output does
        for t in history:
            index.extend([t])
    else:
        index.extend(history)
    return index.propose(k)


@pytest.mark.parametrize("grown", [False, True])
def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix(grown):
    assert lookup([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7], 2, grown) == [3, 4]  # "6 7" last before 3 4
    assert lookup([1, 2, 3, 1, 2, 3, 1, 2], 5, grown) == [3, 1, 2]  # up to the history's end
    assert lookup([9, 1, 2, 8, 2, 5, 1, 2], 2, grown) == [8, 2]  # "1 2" beats the later "2"
    assert lookup([1, 2, 3, 4], 3, grown) == []  # nothing repeats
    assert lookup([7], 3, grown) == []


def test_expected_tokens_counts_the_drafts_kept_in_a_row_and_one_more():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def _state(temperature: float = 1.0, seed: int = 0, vocab: int = 8, **params) -> SequenceSampling:
    return SequenceSampling.create(SamplingParams(temperature=temperature, **params), [1], vocab, seed)


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_adds_the_targets_token():
    logits = np.full((4, 8), -1.0, dtype=np.float32)
    logits[0, 3] = logits[1, 5] = logits[2, 2] = logits[3, 7] = 1.0
    verdict = accept(logits, [3, 5, 6], _state(temperature=0.0))
    assert (verdict.tokens, verdict.kept) == ([3, 5, 2], 2)
    verdict = accept(logits, [3, 5, 2], _state(temperature=0.0))
    assert (verdict.tokens, verdict.kept) == ([3, 5, 2, 7], 3)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with df degrees of freedom (regularized upper gamma, by series)."""
    if x <= 0:
        return 1.0
    a, z = df / 2, x / 2
    term = total = 1.0 / a
    for n in range(1, 1000):
        term *= z / (a + n)
        total += term
        if term < total * 1e-15:
            break
    return max(0.0, 1.0 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total)


def chi2_two_samples(a: np.ndarray, b: np.ndarray) -> float:
    """p-value that counts `a` and `b` (over the same categories) come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    ea, eb = (a + b) * a.sum() / (a.sum() + b.sum()), (a + b) * b.sum() / (a.sum() + b.sum())
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def test_sampled_tokens_follow_the_targets_distribution():
    """Many draws of a row's first kept token (and of the token after a kept draft) against direct draws
    from the target's distribution: a chi-square test cannot tell them apart. A lookup draft is certain (a
    likely but not the likeliest token, then any)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 1.5, (3, 8)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    draws = 40_000
    first = np.zeros(8, dtype=int)
    second = np.zeros(8, dtype=int)
    state = _state(seed=1)
    drafts = [int(np.argsort(p[0])[-2]), 4]
    for _ in range(draws):
        v = accept(logits, drafts, state)
        first[v.tokens[0]] += 1
        if v.kept >= 1:
            second[v.tokens[1]] += 1
    direct = np.bincount(rng.choice(8, size=draws, p=p[0]), minlength=8)
    assert chi2_two_samples(first, direct) > 1e-4
    direct_second = np.bincount(rng.choice(8, size=int(second.sum()), p=p[1]), minlength=8)
    assert chi2_two_samples(second, direct_second) > 1e-4
    assert (first / draws) == pytest.approx(p[0], abs=0.01)  # and it is no other distribution


def test_a_filtered_row_keeps_a_draft_outside_its_top_k_never():
    logits = np.array([[3.0, 2.0, 1.0, 0.0, -1.0]] * 2, dtype=np.float32)
    state = _state(vocab=5, seed=3, top_k=2)
    seen = {accept(logits, [4], state).tokens[0] for _ in range(300)}
    assert seen == {0, 1}


# ---- the engine: speculation on against off ------------------------------------------------------------


def repetitive_prompt(rng: np.random.Generator, length: int = 24) -> list[int]:
    """A prompt that repeats a phrase, so prompt lookup has something to propose."""
    phrase = random_prompt(rng, 6)
    return (phrase * (length // len(phrase) + 1))[:length]


@pytest.fixture
def pair(make_engine):
    """(speculation off, speculation on) engines on the same bundle; the second speculates whenever it has
    drafts (`eager_speculation`)."""
    off = make_engine()
    on = make_engine(speculative="ngram", speculative_tokens=5)
    eager_speculation(on)
    on.warm_up()
    return off, on


def _runs(pair, requests_of):
    return [drive(engine, requests_of()) for engine in pair]


def _logprobs(run, rid):
    return [e.logprob for e in run.events[(rid, 0)]]


def test_greedy_output_is_the_same_tokens_alone_and_batched(pair):
    """The same tokens; the logprobs agree to onnxruntime's rounding: a verification computes several
    positions of a row on the attention kernel's multi-query path, a decode step one (docs/speculative.md)."""
    rng = np.random.default_rng(0)
    prompts = [repetitive_prompt(rng) for _ in range(5)] + [random_prompt(rng, 9)]
    for batch in ([prompts[0]], prompts):
        off, on = _runs(pair, lambda b=batch: [greedy(f"r{i}", p, max_new=40) for i, p in enumerate(b)])
        for i in range(len(batch)):
            assert on.tokens(f"r{i}") == off.tokens(f"r{i}")
            assert _logprobs(on, f"r{i}") == pytest.approx(_logprobs(off, f"r{i}"), abs=1e-4)
    assert pair[1].counters.draft_tokens > 0 and pair[1].counters.accepted_tokens > 0  # it did speculate


def test_each_sequence_reports_its_draft_counts_and_they_sum_to_the_engines(pair):
    """A sequence's last event carries the draft tokens the target checked for it and, of those, the ones it kept
    and the sequence emitted; over every sequence they are the engine's counters, which its snapshot carries.
    Without speculation (off, or a request that leaves it) they are 0."""
    off, on = pair
    rng = np.random.default_rng(6)
    prompts = [repetitive_prompt(rng, 30) for _ in range(3)]

    def requests():
        quiet = greedy("quiet", prompts[0], max_new=20)
        quiet.speculative = False
        return [greedy("g", prompts[0], max_new=40), greedy("stop", prompts[1], max_new=40, stop_token_ids=[prompts[1][4]]),
                sampled("n", prompts[2], max_new=30, seed=3, n=2), quiet]
    run = drive(on, requests())
    last = {key: events[-1] for key, events in run.events.items()}
    proposed = sum(e.draft_tokens for e in last.values())
    accepted = sum(e.accepted_draft_tokens for e in last.values())
    counters = on.stats().speculation
    assert (counters.draft_tokens, counters.accepted_tokens) == (proposed, accepted)
    assert proposed >= accepted > 0 and counters.drafts > 0
    assert counters.acceptance_rate == accepted / proposed
    for key, events in run.events.items():
        assert all(e.draft_tokens == e.accepted_draft_tokens == 0 for e in events[:-1]), key
        assert last[key].accepted_draft_tokens < len(events), key  # kept drafts are among its tokens, never the first
    assert last[("quiet", 0)].draft_tokens == 0
    plain = drive(off, requests())
    assert all(e.draft_tokens == e.accepted_draft_tokens == 0 for events in plain.events.values() for e in events)
    assert off.stats().speculation == SpeculationStats()


def test_the_engine_thread_logs_the_acceptance_rate_when_it_stops_if_it_speculated(pair, caplog):
    async def one_request_then_shutdown(engine: AsyncEngine):
        engine.start()
        async for _ in engine.submit(greedy("r", repetitive_prompt(np.random.default_rng(6), 30), max_new=30)):
            pass
        await engine.shutdown()

    for sync_engine in pair:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="service.engine.speculative_step"):
            asyncio.run(one_request_then_shutdown(AsyncEngine(sync_engine.config, engine=sync_engine)))
        lines = [m for m in caplog.messages if m.startswith("speculative decoding:")]
        s = sync_engine.stats().speculation
        if sync_engine.speculation is None:
            assert lines == []
            continue
        assert s.draft_tokens > 0
        assert lines == [f"speculative decoding: {s.drafts} drafts, {s.draft_tokens} draft tokens proposed, "
                         f"{s.accepted_tokens} accepted (acceptance rate {100 * s.acceptance_rate:.1f}%)"]


def test_stop_conditions_penalties_and_grammars_apply_to_every_kept_token(pair, engine_model):
    rng = np.random.default_rng(1)
    prompt = repetitive_prompt(rng, 30)

    def requests():
        stop_id = prompt[3]
        return [greedy("eos", prompt, max_new=50, stop_token_ids=[stop_id]),
                greedy("limit", prompt, max_new=7),
                GenerationRequest("penalty", prompt, SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                                                    frequency_penalty=0.2),
                                  StoppingCriteria(max_new_tokens=30), logprobs=True),
                GenerationRequest("min", prompt, SamplingParams(temperature=0.0),
                                  StoppingCriteria(max_new_tokens=20, min_new_tokens=12,
                                                   stop_token_ids=[prompt[2]]), logprobs=True)]
    off, on = _runs(pair, requests)
    for rid in ("eos", "limit", "penalty", "min"):
        assert on.tokens(rid) == off.tokens(rid), rid
        assert on.finish(rid) == off.finish(rid), rid


def test_a_grammar_constrained_greedy_request_is_unchanged(pair):
    engine = pair[1]
    try:
        engine.grammars.tokenizer()
    except Exception:
        pytest.skip("this bundle's tokenizer cannot be read by llguidance")
    rng = np.random.default_rng(2)
    prompt = repetitive_prompt(rng)

    def requests():
        return [GenerationRequest("g", prompt, SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=30),
                                  constraint=Constraint("regex", "(ab|cd|[a-z ]){1,40}"), logprobs=True)]
    off, on = _runs(pair, requests)
    assert on.tokens("g") == off.tokens("g")


def test_a_seeded_sampled_request_repeats_itself_and_gives_the_tokens_of_decoding_without_speculation(pair):
    """A prompt-lookup draft is kept when it is the token the target draws with the sequence's next uniform,
    so each emitted token consumes one uniform, as without speculation."""
    rng = np.random.default_rng(3)
    prompt = repetitive_prompt(rng)
    off, on = pair
    requests = [sampled("s", prompt, max_new=30, seed=5), sampled("f", prompt, max_new=30, seed=6, top_k=20,
                                                                   top_p=0.9)]
    first = drive(on, requests)
    again = drive(on, [sampled("s", prompt, max_new=30, seed=5)])
    assert first.tokens("s") == again.tokens("s")
    plain = drive(off, [sampled("s", prompt, max_new=30, seed=5), sampled("f", prompt, max_new=30, seed=6, top_k=20,
                                                                           top_p=0.9)])
    assert first.tokens("s") == plain.tokens("s") and first.tokens("f") == plain.tokens("f")
    assert on.counters.accepted_tokens > 0
    out = sampled("o", prompt, max_new=30, seed=5)
    out.speculative = False
    plain = drive(pair[0], [sampled("o", prompt, max_new=30, seed=5)])
    assert drive(on, [out]).tokens("o") == plain.tokens("o")


def test_sampled_output_keeps_the_distribution_of_decoding_without_speculation(pair):
    """The second generated token of 300 seeded requests with the same repetitive prompt, speculation on
    against off: a chi-square test over the tokens seen cannot tell the two apart."""
    rng = np.random.default_rng(4)
    prompt = repetitive_prompt(rng)
    counts = []
    for engine in pair:
        run = drive(engine, [sampled(f"s{i}", prompt, max_new=3, seed=i) for i in range(300)])
        tokens = [run.tokens(f"s{i}")[1] for i in range(300) if len(run.tokens(f"s{i}")) > 1]
        counts.append(np.bincount(tokens, minlength=engine.model.vocab_size))
    assert chi2_two_samples(*counts) > 1e-4


def _beams(run, rid: str, n: int) -> list[tuple[list[int], float]]:
    return [(run.tokens(rid, j), run.events[(rid, j)][-1].beam_score) for j in range(n)]


@pytest.mark.parametrize("alone", [True, False])
def test_beam_search_never_speculates_and_its_hypotheses_are_those_of_decoding_without_it(pair, alone):
    """A beam takes the token its search chooses, never a draft: alone, and beside greedy requests that speculate,
    a beam search request's hypotheses and scores are the same bits with speculation on or off."""
    rng = np.random.default_rng(8)
    prompts = [repetitive_prompt(rng, 30) for _ in range(4)]

    def requests():
        rs = [beam("b", prompts[0], width=3, n=3, max_new=20), greedy("g", prompts[1], max_new=30),
              beam("b2", prompts[2], width=2, n=1, max_new=16), greedy("h", prompts[3], max_new=30)]
        return rs[:1] if alone else rs
    off, on = _runs(pair, requests)
    assert not on.errors and not off.errors
    assert _beams(on, "b", 3) == _beams(off, "b", 3)
    assert all(len(on.tokens("b", j)) <= 20 for j in range(3))
    assert all(e.draft_tokens == 0 for j in range(3) for e in on.events[("b", j)])
    if not alone:
        assert _beams(on, "b2", 1) == _beams(off, "b2", 1)
        for rid in ("g", "h"):
            assert on.tokens(rid) == off.tokens(rid)
        assert on.events[("g", 0)][-1].draft_tokens > 0  # the greedy rows beside the beams did speculate


def test_prompt_logprobs_are_the_same_with_speculation_on_and_the_request_still_speculates(pair):
    rng = np.random.default_rng(9)
    prompts = [repetitive_prompt(rng, 30) for _ in range(2)]

    def requests():
        scored = GenerationRequest("p", prompts[0], SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=30),
                                   logprobs=True, prompt_logprobs=3)
        return [scored, greedy("g", prompts[1], max_new=30)]
    off, on = _runs(pair, requests)
    assert not on.errors and not off.errors
    first = on.events[("p", 0)][0].prompt_logprobs
    assert first is not None and len(first) == len(prompts[0])
    assert first == off.events[("p", 0)][0].prompt_logprobs  # the prefill is the same call: the same bits
    assert all(e.prompt_logprobs is None for e in on.events[("p", 0)][1:])
    assert on.tokens("p") == off.tokens("p") and on.tokens("g") == off.tokens("g")
    assert on.events[("p", 0)][-1].draft_tokens > 0


def test_the_policy_speculates_where_the_call_times_and_the_measured_rates_say_it_pays(make_engine):
    engine = make_engine(speculative="ngram", speculative_tokens=4)
    engine.warm_up()
    spec = engine.speculation
    spec._propose = lambda seq, k: [1] * k  # the decision is under test, not the lookup
    engine.add(engine.new_request(greedy("p", repetitive_prompt(np.random.default_rng(5)), max_new=40)))
    engine.step()  # the prefill: the sequence now decodes
    decode = engine.scheduler.schedule().decode
    spec.decode_seconds = {1: 1.0, 2: 1.0}
    spec.verify_seconds = np.array([0.0, 1.1, 1.2, 1.3, 1.4])
    decode[0].speculation = Speculation(0.9, NgramIndex())
    assert len(spec.plan(decode).drafts[0]) >= 1  # 4.1 tokens expected from a call of 1.4: worth it
    decode[0].speculation.acceptance = 0.05
    assert spec.plan(decode).drafts == {}  # 1.05 tokens from a call of 1.1: not
    decode[0].speculation.acceptance = 0.9
    spec.rates[1] = {"plain": 100.0, "speculative": 50.0}  # but measured, speculating was the slower
    held = [spec.plan(decode).drafts for _ in range(spec.trial_every)]
    assert all(d == {} for d in held[:-1]) and held[-1]  # it sits out, then tries again
    drive(engine)
