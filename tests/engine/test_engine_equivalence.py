"""The engine's outputs do not depend on what else it runs, and equal the reference implementations.

- batched = alone, greedy and seeded sampling, token for token and logprob for logprob (the same bits),
  with requests joining and leaving at different steps and long prompts chunked across steps while
  others decode, on every graph `--graph auto` may serve, and with the KV cache in float16 and in int8;
- the engine's greedy tokens = a plain greedy loop over the standard ONNX graph = PyTorch;
- reported logprobs = log-softmax of the model's logits.

The first group runs on any bundle (the serving lane's too); the comparisons with PyTorch need the
tiny models built with torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.core import Engine
from service.engine.request import FinishReason, GenerationRequest, SamplingParams, StoppingCriteria
from service.runtime.bundle import read_manifest
from service.runtime.concat_runner import ConcatRunner
from tests.engine.harness import check_event_stream, drive, greedy, random_prompt, run_alone, sampled

N_CTX = 128
SERVED_GRAPHS = ("static", "static-int8", "static-int4")  # what --graph auto may serve: each batch-invariant
KV_GRAPHS = ("static-kv16", "static-kv8")  # the serving graph with its KV cache in float16, in int8 (--kv-dtype)


def record_schedules(engine: Engine) -> list[tuple[int, int, int]]:
    """Wrap the scheduler: one (decode rows, prefill tokens, prefill start) per step; a start past 0 is a
    long prompt's next chunk."""
    log: list[tuple[int, int, int]] = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        p = out.prefill
        log.append((len(out.decode), p.tokens if p else 0, p.start if p else -1))
        return out

    engine.scheduler.schedule = schedule
    return log


def mixed_workload(seed: int) -> dict[int, list[GenerationRequest]]:
    """32 greedy requests: prompts of 1..100 tokens (one of exactly 100), different lengths to
    generate, arriving over the first 30 steps (several at step 0, some while others decode)."""
    rng = np.random.default_rng(seed)
    lengths = [100, 1, 2, 3, 5, 8, 13, 17, 21, 30, 34, 40, 47, 55, 60, 64, 70, 77, 85, 90, 96, 99,
               4, 6, 9, 11, 16, 19, 25, 48, 50, 80]
    assert len(lengths) == 32
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i, length in enumerate(lengths):
        room = N_CTX - length
        max_new = int(rng.integers(1, min(room, 40) + 1))
        step = 0 if i < 4 else int(rng.integers(0, 30))
        arrivals.setdefault(step, []).append(greedy(f"g{i}", random_prompt(rng, length), max_new))
    return arrivals


def assert_same_events(batched, alone, rid: str, index: int = 0) -> None:
    got, want = batched.events[(rid, index)], alone.events[(rid, index)]
    assert [e.token_id for e in got] == [e.token_id for e in want], rid
    assert [e.text for e in got] == [e.text for e in want], rid
    assert [e.finish_reason for e in got] == [e.finish_reason for e in want], rid
    assert [e.logprob for e in got] == [e.logprob for e in want], rid  # the same bits: batch-invariant


@pytest.fixture(params=SERVED_GRAPHS + KV_GRAPHS)
def graph(request, engine_bundle) -> dict:
    """Engine settings serving each graph `--graph auto` may serve that the engine bundle holds, and its KV
    cache twins. The lively model's weights are drawn to make varied text, not to quantize well: its INT8
    graph agrees with fp32 on 89% of the self-check's probe, under the 90% asked of a graph `auto` serves, so
    it is served by name."""
    graphs = read_manifest(engine_bundle).graphs
    if request.param not in graphs:
        pytest.skip(f"the engine bundle has no {request.param!r} graph")
    return dict(graph=request.param, allow_low_agreement=True, kv_dtype=graphs[request.param].cache_dtype)


@pytest.mark.parametrize("max_running,max_batch_tokens", [(32, 48), (5, 24)],
                         ids=["all-running-budget-48", "queued-budget-24"])
def test_batched_greedy_equals_alone(make_engine, graph, max_running, max_batch_tokens):
    arrivals = mixed_workload(seed=1)
    engine = make_engine(**graph, max_running=max_running, max_batch_tokens=max_batch_tokens)
    sched = record_schedules(engine)
    batched = drive(engine, arrivals={k: list(v) for k, v in arrivals.items()})

    # the workload did what it claims: long prompts were chunked while other sequences decoded,
    # and no step went over the token budget
    assert any(decode > 0 and start > 0 for decode, _, start in sched)
    assert all(decode + tokens <= max_batch_tokens for decode, tokens, _ in sched)
    assert max(decode for decode, *_ in sched) >= min(max_running, 16)

    requests = [r for rs in arrivals.values() for r in rs]
    assert not batched.errors
    assert {rid for rid, _ in batched.events} == {r.request_id for r in requests}
    for r in requests:
        alone = run_alone(make_engine, greedy(r.request_id, r.prompt_token_ids, r.stopping.max_new_tokens),
                          **graph)
        check_event_stream(batched, r.request_id)
        assert_same_events(batched, alone, r.request_id)
        n = len(batched.events[(r.request_id, 0)])
        if batched.finish(r.request_id) is FinishReason.LENGTH:
            assert n == r.stopping.max_new_tokens
        else:
            assert batched.finish(r.request_id) is FinishReason.EOS and batched.tokens(r.request_id)[-1] == 0


SAMPLING_COMBOS = [
    dict(temperature=0.8),
    dict(temperature=0.8, top_k=20),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5),
    dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02, frequency_penalty=0.4, repetition_penalty=1.1),
    dict(temperature=1.3, top_p=0.8, frequency_penalty=-0.5, presence_penalty=-0.3),
]


def sampling_workload(seed_offset: int = 0):
    """The combos above (ids s0..), each among greedy and other sampled requests arriving over time."""
    rng = np.random.default_rng(7)
    subjects = [sampled(f"s{i}", random_prompt(rng, 3 + 9 * i), max_new=24, seed=100 + i + seed_offset,
                        stopping={"ignore_eos": True}, **combo)  # 24 tokens each, whatever the model
                for i, combo in enumerate(SAMPLING_COMBOS)]
    others = [greedy(f"o{i}", random_prompt(rng, int(rng.integers(1, 70))), int(rng.integers(1, 30)))
              for i in range(8)]
    others += [sampled(f"t{i}", random_prompt(rng, int(rng.integers(1, 50))), max_new=int(rng.integers(5, 30)),
                       seed=i, temperature=1.0, top_k=10) for i in range(8)]
    arrivals: dict[int, list] = {}
    for i, r in enumerate(others + subjects):
        arrivals.setdefault(int(rng.integers(0, 12)) if i % 3 else 0, []).append(r)
    return subjects, arrivals


def clone(r: GenerationRequest, seed: int | None = None) -> GenerationRequest:
    s = r.sampling
    params = SamplingParams(**{**s.__dict__, "seed": s.seed if seed is None else seed})
    return GenerationRequest(r.request_id, list(r.prompt_token_ids), params, StoppingCriteria(**r.stopping.__dict__),
                             n=r.n, top_logprobs=r.top_logprobs, logprobs=r.logprobs)


def test_seeded_sampling_equals_alone_and_depends_on_the_seed(make_engine, graph):
    subjects, arrivals = sampling_workload()
    batched = drive(make_engine(**graph, max_running=12, max_batch_tokens=40), arrivals=arrivals)
    assert not batched.errors
    distinct = {t for r in subjects for t in batched.tokens(r.request_id)}
    assert len(distinct) > 3 * len(subjects)  # really sampled, not stuck on a few tokens
    for r in subjects:
        alone = run_alone(make_engine, clone(r), **graph)
        assert_same_events(batched, alone, r.request_id)
        other_seed = run_alone(make_engine, clone(r, seed=r.sampling.seed + 1000), **graph)
        assert other_seed.tokens(r.request_id) != alone.tokens(r.request_id), r.sampling


def test_sampling_is_not_greedy(make_engine):
    """Temperature 0.8 leaves the argmax path: seeded runs differ from the greedy one."""
    prompt = random_prompt(np.random.default_rng(3), 10)
    g = run_alone(make_engine, greedy("a", prompt, 24)).tokens("a")
    outs = {tuple(run_alone(make_engine, sampled("a", prompt, 24, seed=s, temperature=0.8)).tokens("a"))
            for s in range(4)}
    assert tuple(g) not in outs and len(outs) == 4


def test_n_siblings_differ_and_the_request_is_reproducible(make_engine):
    prompt = random_prompt(np.random.default_rng(4), 12)

    def request(seed: int) -> GenerationRequest:
        return sampled("fam", prompt, max_new=20, seed=seed, n=4, temperature=0.9, top_p=0.95)

    first = run_alone(make_engine, request(5))
    outs = [first.tokens("fam", i) for i in range(4)]
    assert all(len(o) == 20 for o in outs)
    assert len({tuple(o) for o in outs}) == 4, "siblings must draw from their own streams"
    again = run_alone(make_engine, request(5))
    assert [again.tokens("fam", i) for i in range(4)] == outs
    assert [again.text("fam", i) for i in range(4)] == [first.text("fam", i) for i in range(4)]

    # the same request among others, arriving late, prompt prefilled while others decode
    rng = np.random.default_rng(5)
    others = [sampled(f"x{i}", random_prompt(rng, 20 + i), max_new=15, seed=i, temperature=1.0) for i in range(5)]
    batched = drive(make_engine(max_running=10, max_batch_tokens=30), others, arrivals={3: [request(5)]})
    assert [batched.tokens("fam", i) for i in range(4)] == outs
    other = run_alone(make_engine, request(6))
    assert [other.tokens("fam", i) for i in range(4)] != outs


def test_unseeded_requests_draw_their_own_seed(make_engine):
    prompt = random_prompt(np.random.default_rng(6), 8)
    runs = [run_alone(make_engine, GenerationRequest("u", prompt, SamplingParams(temperature=1.0),
                                                     StoppingCriteria(max_new_tokens=24))).tokens("u")
            for _ in range(2)]
    assert runs[0] != runs[1]


# ---- against the reference implementations -------------------------------------------------------

def onnx_greedy(bundle, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """A plain greedy loop over the standard (Concat-cache) fp32 graph: tokens and each step's logits."""
    r = ConcatRunner(bundle, graph="fp32", provider="cpu")
    length = len(prompt)
    logits, cache = r.step(np.array([prompt]), np.arange(length)[None], np.ones((1, length), np.int64),
                           r.empty_cache(1))
    out, rows = [], []
    for t in range(n):
        row = logits[0, -1]
        rows.append(row)
        out.append(int(row.argmax()))
        pos = length + t
        logits, cache = r.step(np.array([[out[-1]]]), np.array([[pos]]), np.ones((1, pos + 1), np.int64), cache)
    return out, rows


PROMPTS = [[7], [40, 41], list(range(1, 30)), list(range(250, 200, -1)) + list(range(3, 40))]


@pytest.mark.parametrize("which", ["lively", "plain"])
def test_engine_greedy_equals_onnx_loop_and_pytorch(make_engine, lively_bundle, plain_bundle, lively_model_dir,
                                                    tiny_model_dir, which):
    from model.checkpoint import load_model_dir
    from model.generate import generate

    bundle, model_dir = (lively_bundle, lively_model_dir) if which == "lively" else (plain_bundle, tiny_model_dir)
    model, _ = load_model_dir(model_dir)
    n = 30
    reqs = [greedy(f"p{i}", p, n, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    batched = drive(make_engine(bundle=bundle, max_batch_tokens=40), reqs)  # prompts chunked and batched
    for i, prompt in enumerate(PROMPTS):
        want_onnx, _ = onnx_greedy(bundle, prompt, n)
        want_torch = generate(model, [prompt], n, temperature=0.0)[0]
        alone = run_alone(make_engine, greedy("a", prompt, n, ignore_eos=True), bundle=bundle)
        assert want_onnx == want_torch
        assert alone.tokens("a") == want_torch
        assert batched.tokens(f"p{i}") == want_torch
        if which == "lively":
            assert len(set(want_torch)) > 10  # a varied continuation, not one token repeated


def torch_logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def test_logprobs_are_the_models(make_engine, lively_bundle, lively_model_dir):
    import torch

    from model.checkpoint import load_model_dir

    model, _ = load_model_dir(lively_model_dir)
    rng = np.random.default_rng(8)
    prompts = [random_prompt(rng, k) for k in (5, 17, 33)]
    reqs = [GenerationRequest("g", prompts[0], SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=20),
                              top_logprobs=5),
            GenerationRequest("s", prompts[1], SamplingParams(temperature=0.8, top_k=30, repetition_penalty=1.5,
                                                              frequency_penalty=1.0, seed=3),
                              StoppingCriteria(max_new_tokens=20), top_logprobs=2),
            GenerationRequest("z", prompts[2], SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=20))]
    run = drive(make_engine(bundle=lively_bundle, max_batch_tokens=24), reqs)

    # greedy: against the standard ONNX graph, and against PyTorch
    out, onnx_rows = onnx_greedy(lively_bundle, prompts[0], 20)
    evs = run.events[("g", 0)]
    assert [e.token_id for e in evs] == out
    lp = torch_logprobs(model, prompts[0] + out)
    for t, (e, row) in enumerate(zip(evs, onnx_rows, strict=True)):
        ref = torch.log_softmax(torch.from_numpy(row).double(), -1)
        assert e.logprob == pytest.approx(float(ref[e.token_id]), abs=1e-4)
        assert e.logprob == pytest.approx(float(lp[len(prompts[0]) - 1 + t, e.token_id]), abs=1e-4)
        assert len(e.top_logprobs) == 5
        ids = [i for i, _ in e.top_logprobs]
        vals = [v for _, v in e.top_logprobs]
        assert vals == sorted(vals, reverse=True)
        assert ids[0] == e.token_id and vals[0] == pytest.approx(e.logprob, abs=1e-6)
        assert ids == torch.topk(ref, 5).indices.tolist()
        np.testing.assert_allclose(vals, torch.topk(ref, 5).values.numpy(), atol=1e-4)

    # sampled with penalties: the logprob is still the model's own, not the adjusted distribution's
    evs = run.events[("s", 0)]
    toks = [e.token_id for e in evs]
    lp = torch_logprobs(model, prompts[1] + toks)
    for t, e in enumerate(evs):
        row = lp[len(prompts[1]) - 1 + t]
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-4)
        assert len(e.top_logprobs) == 2
        assert [i for i, _ in e.top_logprobs] == torch.topk(row, 2).indices.tolist()
    assert any(e.token_id != e.top_logprobs[0][0] for e in evs)  # it sampled off the argmax

    # a request that asked for neither gets neither (its rows skip the log-softmax)
    assert all(e.top_logprobs is None and e.logprob is None for e in run.events[("z", 0)])
    assert all(e.logprob <= 0.0 for rid in "gs" for e in run.events[(rid, 0)])
