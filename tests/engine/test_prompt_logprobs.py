"""Prompt logprobs (`GenerationRequest.prompt_logprobs`): each prompt token's logprob and alternatives, from
the prefill's logits.

- they equal a log-softmax of the same graph's logits over the whole prompt at once, and PyTorch's;
- the same whether the prompt is prefilled whole, in chunks across steps, or beside other prompts;
- a prompt the prefix cache holds is computed anyway (not looked up), and still gets them;
- they come once, on each sequence's first event; an encoder-decoder refuses them.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.sampler import log_partition
from service.runtime.static_runner import StaticRunner
from tests.engine.harness import drive, greedy, random_prompt


def scored(rid: str, prompt: list[int], k: int, max_new: int = 4, **fields) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=max_new),
                             prompt_logprobs=k, **fields)


def graph_logprobs(bundle, prompt: list[int]) -> np.ndarray:
    """log-softmax of the serving graph's logits at every position of `prompt`, prefilled whole: [len, vocab]."""
    runner = StaticRunner(bundle, graph="static", provider="cpu", intra_op_threads=1)
    with runner.scratch_cache(1):
        logits = runner.prefill_batch(0, [prompt], every_position=True)[0].astype(np.float64)
    return logits - log_partition(logits)[:, None]


def check_against(entries, prompt: list[int], want: np.ndarray, k: int, atol: float) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] == (None, None)
    for i, (logprob, top) in enumerate(entries[1:], start=1):
        row = want[i - 1]
        assert logprob == pytest.approx(row[prompt[i]], abs=atol)
        if k == 0:
            assert top is None
            continue
        ids, values = [t for t, _ in top], [v for _, v in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=atol)
        np.testing.assert_allclose(row[ids], values, atol=atol)


def test_prompt_logprobs_equal_the_graphs_whole_prompt_log_softmax_whole_chunked_and_batched(make_engine,
                                                                                             engine_bundle):
    rng = np.random.default_rng(11)
    long_prompt = random_prompt(rng, 90)  # longer than the budget of 32: prefilled in 3 chunks
    short = [random_prompt(rng, n) for n in (7, 20)]
    engine = make_engine(max_batch_tokens=32)
    run = drive(engine, [scored("long", long_prompt, 3), scored("a", short[0], 0), greedy("plain", short[1], 4),
                         scored("b", short[1], 5)])
    for rid, prompt, k in (("long", long_prompt, 3), ("a", short[0], 0), ("b", short[1], 5)):
        events = run.events[(rid, 0)]
        check_against(events[0].prompt_logprobs, prompt, graph_logprobs(engine_bundle, prompt), k, atol=1e-5)
        assert all(e.prompt_logprobs is None for e in events[1:])  # delivered once
    assert all(e.prompt_logprobs is None for e in run.events[("plain", 0)])

    # the long prompt alone, prefilled whole: the same numbers as in chunks beside others
    alone = drive(make_engine(max_batch_tokens=128), [scored("long", long_prompt, 3)])
    chunked, whole = run.events[("long", 0)][0].prompt_logprobs, alone.events[("long", 0)][0].prompt_logprobs
    np.testing.assert_allclose([lp for lp, _ in chunked[1:]], [lp for lp, _ in whole[1:]], atol=1e-5)
    assert run.tokens("long") == alone.tokens("long")


def test_prompt_logprobs_equal_pytorchs(make_engine, lively_bundle, lively_model_dir):
    import torch

    from model.checkpoint import load_model_dir

    model, _ = load_model_dir(lively_model_dir)
    prompt = random_prompt(np.random.default_rng(12), 70)
    run = drive(make_engine(bundle=lively_bundle, max_batch_tokens=24), [scored("r", prompt, 4)])
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt]))[0].double(), dim=-1).numpy()
    check_against(run.events[("r", 0)][0].prompt_logprobs, prompt, want, 4, atol=1e-4)


def test_a_prompt_in_the_prefix_cache_is_computed_and_scored(make_engine, engine_bundle):
    prompt = random_prompt(np.random.default_rng(13), 50)
    engine = make_engine()
    drive(engine, [greedy("warm", prompt, 4)])
    hits = engine.stats().prefix_hit_tokens
    run = drive(engine, [scored("r", prompt, 2)])
    assert engine.stats().prefix_hit_tokens == hits  # not looked up
    check_against(run.events[("r", 0)][0].prompt_logprobs, prompt, graph_logprobs(engine_bundle, prompt), 2,
                  atol=1e-5)
    assert run.events[("r", 0)][0].token_id == drive(engine, [greedy("again", prompt, 1)]).tokens("again")[0]


def test_every_sequence_gets_them_on_its_first_event(make_engine):
    prompt = random_prompt(np.random.default_rng(14), 9)
    request = GenerationRequest("n", prompt, SamplingParams(seed=1), StoppingCriteria(max_new_tokens=3), n=3,
                                prompt_logprobs=1)
    run = drive(make_engine(), [request])
    firsts = [run.events[("n", i)][0].prompt_logprobs for i in range(3)]
    assert all(f is not None and len(f) == len(prompt) and f == firsts[0] for f in firsts)


@pytest.mark.parametrize("k", [-1, 21])
def test_out_of_range_is_refused(make_engine, k):
    with pytest.raises(InvalidRequest, match=r"prompt_logprobs.*outside \[0, 20\]"):
        make_engine().new_request(scored("r", [1, 2, 3], k))


def test_an_encoder_decoder_refuses_them(make_engine, seq2seq_bundle):
    engine = make_engine(bundle=seq2seq_bundle)
    with pytest.raises(InvalidRequest, match="encoder-decoder") as e:
        engine.new_request(scored("r", [5, 6, 7], 0))
    assert e.value.field == "prompt_logprobs"
