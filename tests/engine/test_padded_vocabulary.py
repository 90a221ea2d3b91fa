"""A model whose vocabulary is padded past its tokenizer's (as many checkpoints are) never samples
the padding ids: they have no text, and decoding them must not fail a step. Nor are they among a
prompt's logprob alternatives."""

from __future__ import annotations

import pytest

from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.engine.request import GenerationRequest, StoppingCriteria
from tests.conftest import make_model
from tests.engine.harness import drive, sampled

pytestmark = pytest.mark.needs_torch(reason="builds its padded model with torch")


@pytest.fixture(scope="module")
def padded_bundle(tmp_path_factory, tiny_tokenizer):
    import torch

    from export.bundle_writer import export_bundle
    from model.checkpoint import save_model_dir

    model_dir = tmp_path_factory.mktemp("padded-model")
    # a large output bias on the padding rows makes them the likeliest ids unless they are excluded
    model = make_model(vocab_size=tiny_tokenizer.vocab_size + 20, n_ctx=64)
    with torch.no_grad():
        model.tok_emb.weight[tiny_tokenizer.vocab_size:] *= 50
    save_model_dir(model, tiny_tokenizer, model_dir)
    out = tmp_path_factory.mktemp("padded-bundle")
    export_bundle(model_dir, out, name="padded")
    return out


def test_padding_ids_are_never_sampled(padded_bundle, tiny_tokenizer):
    engine = Engine(EngineConfig(bundle=padded_bundle, max_running=4, max_batch_tokens=64))
    assert engine.sampleable == tiny_tokenizer.vocab_size < engine.model.vocab_size
    requests = [sampled(f"r{i}", [5, 6, 7], 40, seed=i, temperature=2.0) for i in range(4)]
    run = drive(engine, requests)
    assert run.errors == {}
    for r in requests:
        tokens = run.tokens(r.request_id, 0)
        assert len(tokens) > 0 and all(t < tiny_tokenizer.vocab_size for t in tokens)


def test_prompt_logprobs_leave_the_padding_ids_out(padded_bundle, tiny_tokenizer):
    engine = Engine(EngineConfig(bundle=padded_bundle, max_running=4, max_batch_tokens=64))
    prompt = [5, 6, 7, 8, 9]
    run = drive(engine, [GenerationRequest("r", prompt, stopping=StoppingCriteria(max_new_tokens=2), logprobs=True,
                                           top_logprobs=3, prompt_logprobs=3)])
    first = run.events[("r", 0)][0]
    entries = first.prompt_logprobs
    assert run.errors == {} and len(entries) == len(prompt)
    for logprob, top in entries[1:]:
        assert all(t < tiny_tokenizer.vocab_size for t, _ in top) and logprob <= top[0][1]
    # the same distribution as the generated tokens' logprobs: over the ids the model can emit
    assert [t for t, _ in first.top_logprobs] and all(t < tiny_tokenizer.vocab_size for t, _ in first.top_logprobs)
