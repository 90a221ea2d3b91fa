"""A Llama-style bundle (rotary positions, RMSNorm, SwiGLU, grouped-query attention) served over gRPC with
every option that works for GPT-2: what the server returns equals the engine alone, batched or not."""

from __future__ import annotations

import concurrent.futures

import pytest

from service.client import Client, build_request
from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.fronts.grpc.protocol import parse_request
from service.fronts.validation import ModelFacts
from tests.engine.harness import drive
from tests.fronts.server_harness import ServerThread, settings

PROMPTS = ["Rom.\nBut soft", "Ham.\nTo be, or not", "Mac.\nTomorrow", "It is the east"]


@pytest.fixture(scope="module")
def llama_server(llama_bundle):
    with ServerThread(settings(llama_bundle, graph="static")) as srv, Client(srv.address, timeout_s=60) as c:
        yield srv, c


def alone(bundle, prompt: str, **fields) -> list[list[int]]:
    engine = Engine(EngineConfig(bundle=bundle, graph="static", max_running=8, max_batch_tokens=256))
    facts = ModelFacts(engine.tokenizer, engine.model.n_ctx, engine.limits)
    accepted = parse_request(build_request(prompt, **fields), facts)
    run = drive(engine, [accepted.request])
    return [run.tokens(accepted.request.request_id, i) for i in range(accepted.request.n)]


def test_model_info_reports_the_architecture_and_the_kv_heads(llama_server):
    _, c = llama_server
    m = c.model_info()
    assert (m.architecture, m.attention_heads, m.kv_heads, m.layers) == ("llama", 4, 2, 2)
    assert c.server_info().kv_slots == 8


def test_sampling_n_logprobs_and_stream_equal_the_engine_alone(llama_server, llama_bundle):
    _, c = llama_server
    fields = dict(n=2, temperature=0.9, top_p=0.9, seed=7, max_new_tokens=24, logprobs=True, top_logprobs=2,
                  ignore_eos=True)
    unary = c.generate(PROMPTS[0], **fields)
    want = alone(llama_bundle, PROMPTS[0], **fields)
    assert [list(x.token_ids) for x in unary.completions] == want
    assert all(len(x.logprobs) == 24 and len(x.logprobs[0].top) == 2 for x in unary.completions)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for msg in c.stream_responses(PROMPTS[0], **fields):
        streamed[msg.index] += list(msg.token_ids)
    assert [streamed[0], streamed[1]] == want


def test_concurrent_streams_each_equal_their_run_alone(llama_server, llama_bundle):
    _, c = llama_server
    requests = [dict(prompt=p, seed=i, temperature=0.8, max_new_tokens=30, ignore_eos=True)
                for i, p in enumerate(PROMPTS * 3)]

    def one(r):
        fields = {k: v for k, v in r.items() if k != "prompt"}
        return list(c.generate(r["prompt"], **fields).completions[0].token_ids)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(one, requests))
    for r, tokens in zip(requests, got, strict=True):
        fields = {k: v for k, v in r.items() if k != "prompt"}
        assert tokens == alone(llama_bundle, r["prompt"], **fields)[0]
