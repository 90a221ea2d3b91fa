"""The gRPC server end to end: a real server on a free localhost port, called through the stubs,
the Python clients and the CLI. Results are checked against the in-process engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from attnserve.v1 import generate_pb2 as pb
from service.client import AsyncClient, build_request
from service.fronts.grpc.protocol import parse_request
from service.fronts.validation import ModelFacts
from service.runtime.tokenizer import Tokenizer
from tests.engine.harness import drive
from tests.fronts.server_harness import free_port, wait_until

PROMPTS = ["Rom.\nBut soft", "Ham.\nTo be, or not", "Mac.\nTomorrow", "It is the east"]


@pytest.fixture(scope="module")
def tokenizer(engine_bundle) -> Tokenizer:
    return Tokenizer.from_file(engine_bundle / "tokenizer.json", eos_id=0)


def expected(make_engine, tokenizer, prompt, **fields) -> list[list[int]]:
    """Token ids of each completion, from the in-process engine given the same request alone."""
    engine = make_engine(max_running=16)
    accepted = parse_request(build_request(prompt, **fields), ModelFacts(tokenizer, engine.model.n_ctx, engine.limits))
    run = drive(engine, [accepted.request])
    return [run.tokens(accepted.request.request_id, i) for i in range(accepted.request.n)]


def test_unary_generate_equals_the_engine_alone(client, make_engine, tokenizer):
    for i, prompt in enumerate(PROMPTS):
        fields = dict(temperature=0.8, top_k=40, seed=100 + i, max_new_tokens=30)
        response = client.generate(prompt, request_id=f"u{i}", **fields)
        assert response.request_id == f"u{i}"
        [c] = response.completions
        assert list(c.token_ids) == expected(make_engine, tokenizer, prompt, **fields)[0]
        assert c.text == tokenizer.decode(list(c.token_ids)) or c.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert c.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS_TOKEN)
        assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert response.usage.completion_tokens == len(c.token_ids)
        assert 0 <= response.usage.queue_ms <= response.usage.ttft_ms <= response.usage.total_ms


def test_stream_carries_the_same_result_as_unary(client):
    fields = dict(temperature=0.9, seed=7, max_new_tokens=40, ignore_eos=True)
    unary = client.generate(PROMPTS[0], **fields).completions[0]
    msgs = list(client.stream_responses(PROMPTS[0], **fields))
    assert "".join(m.text for m in msgs) == unary.text
    assert [t for m in msgs for t in m.token_ids] == list(unary.token_ids)
    assert [m.finish_reason for m in msgs[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(msgs) - 1)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [m.HasField("usage") for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert msgs[-1].usage.completion_tokens == 40
    assert "".join(client.stream(PROMPTS[0], **fields)) == unary.text


def test_n_completions_echo_and_logprobs(client, make_engine, tokenizer):
    fields = dict(n=3, temperature=1.0, seed=3, max_new_tokens=12, ignore_eos=True, top_logprobs=2, echo=True)
    response = client.generate(PROMPTS[1], **fields)
    want = expected(make_engine, tokenizer, PROMPTS[1], **fields)
    assert [c.index for c in response.completions] == [0, 1, 2]
    for c, ids in zip(response.completions, want, strict=True):
        assert list(c.token_ids) == ids
        assert c.text.startswith(PROMPTS[1])
        assert len(c.logprobs) == 12 and all(len(lp.top) == 2 for lp in c.logprobs)
        assert [lp.token_id for lp in c.logprobs] == ids
        assert all(lp.logprob <= 0 and lp.top[0].logprob >= lp.top[1].logprob for lp in c.logprobs)
    msgs = list(client.stream_responses(PROMPTS[1], **fields))
    for i, c in enumerate(response.completions):
        mine = [m for m in msgs if m.index == i]
        assert mine[0].text.startswith(PROMPTS[1])
        assert "".join(m.text for m in mine) == c.text
        assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 36
    plain = client.generate(PROMPTS[1], max_new_tokens=4, seed=1)
    assert not plain.completions[0].logprobs  # only when asked for


def test_prompt_token_ids_and_stop_strings(client, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    by_text = client.generate(PROMPTS[2], temperature=0.0, max_new_tokens=20)
    by_ids = client.generate(ids, temperature=0.0, max_new_tokens=20)
    assert by_ids.completions[0].token_ids == by_text.completions[0].token_ids
    text = by_text.completions[0].text
    assert len(text) >= 8
    stop = text[5:8]
    cut = client.generate(PROMPTS[2], temperature=0.0, max_new_tokens=20, stop=[stop]).completions[0]
    assert cut.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert cut.text == text[:text.index(stop)]


def test_defaults_when_fields_are_unset(client, make_engine, tokenizer, engine_model):
    """max_new_tokens 0 -> 64 (the default); temperature unset -> 1.0; n 0 -> 1."""
    response = client.generate(PROMPTS[3], seed=11, ignore_eos=True)
    [c] = response.completions
    assert len(c.token_ids) == 64
    assert list(c.token_ids) == expected(make_engine, tokenizer, PROMPTS[3], seed=11, ignore_eos=True,
                                         temperature=1.0, max_new_tokens=64)[0]
    long_prompt = list(range(1, engine_model.n_ctx - 27))  # 28 tokens short of the context: the default is lowered
    assert len(client.generate(long_prompt, seed=1, ignore_eos=True).completions[0].token_ids) == 28


def test_truncate_prompt_keeps_the_newest_tokens(client, engine_model):
    """A prompt 72 tokens longer than the context (200 tokens for context 128) with 20 new tokens keeps its
    last n_ctx - 20 tokens; without the flag it is refused; with the default max_new_tokens the prompt
    makes room for the default 64."""
    n_ctx = engine_model.n_ctx
    prompt = [1 + i % 250 for i in range(n_ctx + 72)]
    fields = dict(max_new_tokens=20, ignore_eos=True, temperature=0.0)
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, **fields)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("prompt:")
    cut = client.generate(prompt, truncate_prompt=True, **fields)
    assert cut.usage.prompt_tokens == n_ctx - 20
    assert (list(cut.completions[0].token_ids)
            == list(client.generate(prompt[-(n_ctx - 20):], **fields).completions[0].token_ids))
    default = client.generate(prompt, truncate_prompt=True, ignore_eos=True, seed=1)
    assert len(default.completions[0].token_ids) == 64 and default.usage.prompt_tokens == n_ctx - 64


def test_32_concurrent_streams_all_complete_correctly(server, client):
    requests = [dict(prompt=PROMPTS[i % 4] + " " * (i % 3), temperature=0.7 + 0.01 * i, seed=i, max_new_tokens=24 + i,
                     ignore_eos=True) for i in range(32)]
    alone = [client.generate(**r).completions[0] for r in requests]  # one at a time: the reference

    async def one(c: AsyncClient, r: dict) -> tuple[str, list[int], int]:
        text, ids, finish = [], [], 0
        async for m in c.stream_responses(**r):
            text.append(m.text)
            ids += m.token_ids
            finish = m.finish_reason or finish
        return "".join(text), ids, finish

    async def all_at_once():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return await asyncio.gather(*(one(c, r) for r in requests))

    results = asyncio.run(all_at_once())
    for r, want, (text, ids, finish) in zip(requests, alone, results, strict=True):
        assert ids == list(want.token_ids) and len(ids) == r["max_new_tokens"]
        assert text == want.text and finish == pb.FINISH_REASON_LENGTH
    info = client.server_info()
    assert info.requests_running == 0 and info.kv_free_slots == info.kv_slots


def test_async_client_generate_and_stream(server, engine_model):
    async def go():
        async with AsyncClient(server.address, timeout_s=60) as c:
            unary = await c.generate("Ham.", seed=5, max_new_tokens=16, ignore_eos=True)
            deltas = [d async for d in c.stream("Ham.", seed=5, max_new_tokens=16, ignore_eos=True)]
            return unary, deltas, await c.model_info(), await c.tokenize("Ham.")

    unary, deltas, info, tokens = asyncio.run(go())
    assert "".join(deltas) == unary.completions[0].text
    assert info.context_tokens == engine_model.n_ctx and info.vocab_size == engine_model.vocab_size
    assert len(tokens.token_ids) == len(tokens.tokens) > 0


def test_tokenize_model_info_server_info(server, client, tokenizer, engine_model):
    t = client.tokenize("To be, or not to be")
    assert list(t.token_ids) == tokenizer.encode("To be, or not to be")
    assert "".join(t.tokens) == "To be, or not to be"
    m = client.model_info()
    want = engine_model
    assert (m.name, m.vocab_size, m.context_tokens, m.eos_token_id) == (want.name, want.vocab_size, want.n_ctx, 0)
    assert m.provider == "CPUExecutionProvider" and m.graph == "static" and m.dtype == "float32"
    assert (m.architecture, m.attention_heads, m.kv_heads, m.layers) == (
        want.architecture, want.n_head, want.kv_heads, want.n_layer)
    assert list(m.eos_token_ids) == [m.eos_token_id]
    s = client.server_info()
    assert s.kv_slots == server.settings.max_running and want.n_ctx <= s.kv_tokens and s.kv_free_tokens == s.kv_tokens  # idle
    assert s.uptime_seconds > 0 and s.version


def test_health_serving_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "attnserve.v1.TextGeneration"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"attnserve.v1.TextGeneration", "grpc.health.v1.Health"} <= services
        proto = db.FindFileContainingSymbol("attnserve.v1.GenerateRequest")
        fields = [f.name for m in proto.message_type if m.name == "GenerateRequest" for f in m.field]
        assert fields == [f.name for f in pb.GenerateRequest.DESCRIPTOR.fields]


def test_metrics_endpoint(server, client):
    client.generate("Rom.", max_new_tokens=5, seed=1)
    with pytest.raises(grpc.RpcError):
        client.generate("Rom.", top_p=5.0)
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"

    def scrape() -> str:
        return urllib.request.urlopen(url, timeout=10).read().decode()

    # the status reaches the client just before the server counts it
    wait_until(lambda: 'code="INVALID_ARGUMENT",method="Generate",protocol="grpc"' in scrape(), what="the refused call to be counted")
    body = scrape()
    for name in ("attnserve_time_to_first_token_seconds_bucket", "attnserve_inter_token_latency_seconds_count",
                 "attnserve_request_duration_seconds_sum", "attnserve_queue_duration_seconds_count",
                 "attnserve_requests_running", "attnserve_requests_waiting", "attnserve_kv_cache_usage_ratio",
                 "attnserve_generated_tokens_total", "attnserve_prompt_tokens_total",
                 "attnserve_prefix_cache_hit_rate", "attnserve_prefix_cache_queried_tokens_total",
                 "attnserve_prefix_cache_hit_tokens_total"):
        assert f"\n{name}" in body, name
    assert 'attnserve_requests_total{code="OK",method="Generate",protocol="grpc"}' in body
    assert 'attnserve_requests_total{code="INVALID_ARGUMENT",method="Generate",protocol="grpc"}' in body
    served = client.model_info().name  # per-request series carry the request's model
    generated = next(float(line.split()[-1]) for line in body.splitlines()
                     if line.startswith(f'attnserve_generated_tokens_total{{model="{served}"}} '))
    assert generated >= 5


def test_cli_generate_against_the_server(server, client):
    want = client.generate("Rom.", temperature=0.8, seed=4, max_new_tokens=20, ignore_eos=True).completions[0].text
    for extra in (["--stream"], []):
        out = subprocess.run([sys.executable, "-m", "attnserve", "generate", "Rom.", *extra, "--temperature", "0.8",
                              "--seed", "4", "--max-new-tokens", "20", "--ignore-eos", "--server", server.address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "Rom." + want and "[length]" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "attnserve", "generate", "Rom.", "--top-p", "3", "--server",
                          server.address], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "sampling.top_p" in bad.stderr


def test_health_probe_command(server):
    """`--server` as in `attnserve generate`; `--address`, its earlier name, still works."""
    for flag in ("--server", "--address"):
        ok = subprocess.run([sys.executable, "-m", "attnserve", "health", flag, server.address],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and ok.stdout == f"{server.address}: SERVING\n", (flag, ok.stderr)
    down = subprocess.run([sys.executable, "-m", "attnserve", "health", "--server", f"127.0.0.1:{free_port()}",
                           "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
