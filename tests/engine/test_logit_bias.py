"""logit_bias in the engine: -100 bans a token and +100 forces it, sampled or greedy, beside top-k/top-p,
penalties, a grammar and speculative decoding; a biased request changes no other request's tokens; the
reported logprobs are the model's own; bad biases and beam search with a bias are refused by name."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import (
    MAX_LOGIT_BIAS,
    BeamParams,
    Constraint,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    build,
)
from tests.engine.harness import drive, eager_speculation, random_prompt, run_alone, sampled

BANNED_OVER = 1000  # sampled tokens a banned token must stay out of


def biased(rid: str, prompt: list[int], bias: dict[int, float], max_new: int = 16, seed: int = 0,
           constraint: Constraint | None = None, **sampling) -> GenerationRequest:
    """A seeded request with `bias` and logprobs on; without a constraint EOS is ignored, so every sequence runs
    its max_new tokens (a constrained one ends where its grammar does)."""
    return GenerationRequest(rid, list(prompt), SamplingParams(seed=seed, logit_bias=bias, **sampling),
                             StoppingCriteria(max_new_tokens=max_new, ignore_eos=constraint is None), logprobs=True,
                             constraint=constraint)


def test_a_banned_token_never_appears_in_a_thousand_sampled_tokens(make_engine):
    rng = np.random.default_rng(11)
    prompts = [random_prompt(rng, 5) for _ in range(10)]
    per_request = BANNED_OVER // len(prompts)
    free = drive(make_engine(), [biased(f"f{i}", p, {}, per_request, seed=i, temperature=1.0)
                                 for i, p in enumerate(prompts)])
    counts = Counter(t for i in range(len(prompts)) for t in free.tokens(f"f{i}"))
    banned = counts.most_common(1)[0][0]  # the token the model samples most often from these prompts
    assert counts[banned] >= 10
    run = drive(make_engine(), [biased(f"b{i}", p, {banned: -100}, per_request, seed=i, temperature=1.0)
                                for i, p in enumerate(prompts)])
    tokens = [t for i in range(len(prompts)) for t in run.tokens(f"b{i}")]
    assert len(tokens) == BANNED_OVER and banned not in tokens


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
                                      dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=1.0,
                                           frequency_penalty=0.5)])
def test_a_bias_of_100_forces_its_token(make_engine, sampling):
    rng = np.random.default_rng(12)
    prompt = random_prompt(rng, 6)
    greedy_first = drive(make_engine(), [biased("g", prompt, {}, 1, temperature=0.0)]).tokens("g")[0]
    forced = 7 if greedy_first != 7 else 8  # not what the model would choose anyway
    run = drive(make_engine(), [biased("f", prompt, {forced: 100}, 20, **sampling)])
    assert run.tokens("f") == [forced] * 20


def test_a_biased_request_changes_no_other_requests_tokens(make_engine):
    """Batch invariance: a biased row is biased in its own row only; both rows are bit-identical to alone."""
    rng = np.random.default_rng(13)
    plain = sampled("plain", random_prompt(rng, 7), 24, seed=3, temperature=0.9)
    tilted = biased("tilted", random_prompt(rng, 9), {5: 4.0, 6: -3.0, 40: 2.5}, 24, seed=4, temperature=0.9)
    together = drive(make_engine(), [plain, tilted])
    for r in (plain, tilted):
        alone = run_alone(make_engine, r)
        assert together.tokens(r.request_id) == alone.tokens(r.request_id)
        assert [e.logprob for e in together.events[(r.request_id, 0)]] == \
               [e.logprob for e in alone.events[(r.request_id, 0)]]


def test_reported_logprobs_are_the_models_own_not_the_biased_ones(make_engine):
    rng = np.random.default_rng(14)
    prompt = random_prompt(rng, 6)
    free = GenerationRequest("free", list(prompt), SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=1),
                             top_logprobs=5)
    [top] = [e.top_logprobs for e in drive(make_engine(), [free]).events[("free", 0)]]
    second, its_logprob = top[1]  # the model's second choice: forced, it is reported with its own logprob
    run = drive(make_engine(), [biased("f", prompt, {second: 100}, 1, temperature=0.0)])
    [event] = run.events[("f", 0)]
    assert event.token_id == second and event.logprob == pytest.approx(its_logprob, abs=1e-6)


def test_a_bias_cannot_force_what_the_grammar_forbids(make_engine):
    """The grammar's mask comes first: +100 on every token that no choice starts with changes nothing, and
    -100 on every token that starts "ab" leaves "cd"."""
    engine = make_engine()
    texts = {t: engine.tokenizer.decode([t]) for t in range(engine.sampleable)}
    starts = {c: {t for t, text in texts.items() if text and c.startswith(text)} for c in ("ab", "cd")}
    outside = [t for t, text in texts.items() if text and t not in starts["ab"] | starts["cd"]][:50]
    choice = Constraint("choice", '["ab", "cd"]')
    prompt = random_prompt(np.random.default_rng(15), 5)
    run = drive(engine, [biased(f"c{seed}", prompt, dict.fromkeys(outside, 100.0), 8, seed=seed, temperature=1.0,
                                constraint=choice) for seed in range(4)])
    assert all(run.text(f"c{seed}") in ("ab", "cd") for seed in range(4))
    run = drive(make_engine(), [biased(f"d{seed}", prompt, dict.fromkeys(starts["ab"], -100.0), 8, seed=seed,
                                       temperature=1.0, constraint=choice) for seed in range(4)])
    assert all(run.text(f"d{seed}") == "cd" for seed in range(4))


def test_speculative_decoding_checks_drafts_against_the_biased_distribution(make_engine):
    """A repetitive prompt gives prompt lookup drafts; with a bias, the verification uses the biased
    distribution, so the seeded tokens are those decoding without speculation gives, a banned token that
    the drafts propose is never kept, and a forced token's drafts (its own repeats) are kept."""
    prompt = [11, 12, 13, 14, 15] * 4
    request = biased("s", prompt, {12: -100, 14: 3.0}, 40, seed=5, temperature=0.8)
    off = run_alone(make_engine, request)
    engine = make_engine(speculative="ngram", speculative_tokens=4)
    eager_speculation(engine)
    engine.warm_up()
    on = drive(engine, [request])
    assert engine.counters.draft_tokens > 0  # it did speculate
    assert on.tokens("s") == off.tokens("s") and 12 not in on.tokens("s")
    kept = engine.counters.accepted_tokens
    forced = drive(engine, [biased("f", prompt, {13: 100}, 40, seed=6, temperature=0.8)])
    assert forced.tokens("f") == [13] * 40 and engine.counters.accepted_tokens > kept


@pytest.mark.parametrize("bias, field, message", [
    ({5: 100.5}, "sampling.logit_bias.5", "outside [-100, 100]"),
    ({5: -101}, "sampling.logit_bias.5", "outside [-100, 100]"),
    ({5: float("nan")}, "sampling.logit_bias.5", "not a finite number"),
    ({5: float("inf")}, "sampling.logit_bias.5", "not a finite number"),
    ({5: "x"}, "sampling.logit_bias.5", "must be a number"),
    ({-1: 1.0}, "sampling.logit_bias.-1", "not a token id"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "sampling.logit_bias", f"the most allowed is {MAX_LOGIT_BIAS}"),
])
def test_bad_biases_are_refused_by_name(bias, field, message):
    with pytest.raises(InvalidRequest) as e:
        build(SamplingParams, "sampling", {"logit_bias": bias})
    assert e.value.field == field and message in str(e.value)


def test_an_id_outside_the_vocabulary_is_refused_by_the_engine(make_engine, engine_model):
    engine = make_engine()
    vocab = engine_model.vocab_size
    with pytest.raises(InvalidRequest) as e:
        engine.new_request(biased("v", [1, 2, 3], {3: 1.0, vocab: 1.0}))
    assert e.value.field == f"sampling.logit_bias.{vocab}" and f"[0, {vocab - 1}]" in str(e.value)
    engine.new_request(biased("v", [1, 2, 3], {vocab - 1: 1.0}))  # the last id is fine


def test_a_bias_with_beam_search_is_refused_by_name(make_engine):
    request = GenerationRequest("b", [1, 2, 3], SamplingParams(temperature=0.0, logit_bias={5: 1.0}),
                                StoppingCriteria(max_new_tokens=4), n=2, beam=BeamParams(3))
    with pytest.raises(InvalidRequest) as e:
        make_engine().new_request(request)
    assert e.value.field == "sampling.logit_bias"
