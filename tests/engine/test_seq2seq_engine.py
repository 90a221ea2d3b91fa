"""The engine on an encoder-decoder bundle: the prompt is the source, the completion the target.

Sources are encoded in batches like prefill, targets decoded in continuous batches; the outputs do
not depend on what else runs (batch invariance), and equal PyTorch's greedy decoding."""

from __future__ import annotations

import time

import numpy as np
import pytest

from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.engine.errors import DeadlineExceeded, InvalidRequest
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from tests.engine.harness import Run, check_event_stream, check_idle, drive, greedy, sampled

WORDS = ["transformer", "attention", "cat", "onnxruntime", "a", "encoder", "decoder", "kubernetes", "serving",
         "phoneme", "x", "grapheme"]


@pytest.fixture
def make_s2s(seq2seq_bundle):
    def make(**overrides) -> Engine:
        # the fp32 pair, whatever else the bundle holds: every engine of a test computes the same logits
        config = dict(bundle=seq2seq_bundle, graph="static", max_running=4, max_batch_tokens=64, threads=1)
        return Engine(EngineConfig(**{**config, **overrides}))

    return make


def sources(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(w) for w in WORDS]


def test_a_batch_gives_each_source_what_it_gets_alone(make_s2s):
    engine = make_s2s()
    assert engine.encoder_decoder and engine.prefixes is None
    srcs = sources(engine)
    alone = {f"w{i}": drive(make_s2s(max_running=1), [greedy(f"w{i}", s, 12)]).events[(f"w{i}", 0)]
             for i, s in enumerate(srcs[:5])}
    # 12 requests through 4 slots, some arriving while others decode: continuous batching
    arrivals = {3: [greedy(f"w{i}", s, 12) for i, s in enumerate(srcs) if i >= 6]}
    run = drive(engine, [greedy(f"w{i}", s, 12) for i, s in enumerate(srcs) if i < 6], arrivals)
    assert not run.errors
    for rid, events in alone.items():  # the same tokens, and logprobs to the bit: batch-invariant
        assert [(e.token_id, e.logprob) for e in run.events[(rid, 0)]] == [(e.token_id, e.logprob) for e in events]
    assert all(0 < len(run.tokens(f"w{i}")) <= 12 for i in range(len(WORDS)))
    for i in range(len(WORDS)):
        check_event_stream(run, f"w{i}")


def test_new_sources_join_the_decode_call_and_change_nothing(make_s2s):
    """Sources admitted while others decode are encoded, and their first target token decoded in the decode
    call: one decoder call a step, the same tokens and logprobs as a prefill call of their own."""
    srcs = sources(make_s2s())

    def run(merge: bool) -> tuple[Run, int]:
        engine = make_s2s()
        if not merge:
            engine.run_step._joins_decode = lambda *_: False
        prefills = 0
        prefill_batch = engine.runner.prefill_batch

        def counted(*args, **kwargs):
            nonlocal prefills
            prefills += 1
            return prefill_batch(*args, **kwargs)

        engine.runner.prefill_batch = counted
        arrivals = {2: [greedy(f"w{i}", s, 10) for i, s in enumerate(srcs) if i >= 3]}
        out = drive(engine, [greedy(f"w{i}", s, 10) for i, s in enumerate(srcs) if i < 3], arrivals)
        check_idle(engine)
        return out, prefills

    (joined, prefills_joined), (apart, prefills_apart) = run(True), run(False)
    assert not joined.errors and not apart.errors
    for i in range(len(WORDS)):
        assert [(e.token_id, e.logprob) for e in joined.events[(f"w{i}", 0)]] == [
            (e.token_id, e.logprob) for e in apart.events[(f"w{i}", 0)]]
        check_event_stream(joined, f"w{i}")
    assert prefills_joined == 0 < prefills_apart  # every source is encoded, then decoded in a decode call


def test_an_encode_that_fails_in_the_joined_step_fails_only_its_request(make_s2s):
    engine = make_s2s()
    srcs = sources(engine)
    encode = engine.runner.encode

    def encode_or_fail(first_slot, chunks):
        if any(chunk == srcs[4] for chunk in chunks):
            raise RuntimeError("the encoder refused this source")
        return encode(first_slot, chunks)

    engine.runner.encode = encode_or_fail
    want = drive(make_s2s(), [greedy("keep", srcs[0], 10, ignore_eos=True)]).tokens("keep")
    run = drive(engine, [greedy("keep", srcs[0], 10, ignore_eos=True)],
                {2: [greedy("bad", srcs[4], 10), greedy("fine", srcs[5], 10)]})
    assert run.tokens("keep") == want and run.tokens("fine")
    assert "bad" in run.errors and set(run.errors) == {"bad"}
    check_idle(engine)


@pytest.mark.parametrize("graph", ["static", "static-int8"])
def test_each_graph_gives_a_source_the_same_bits_alone_and_in_a_batch(seq2seq_int8_bundle, graph):
    """On every core (threads 0) a small model's calls of up to SMALL_ROWS rows run on its one-thread
    session, larger ones on every core: a source's logits are the same bits alone, on the one, and among
    more than SMALL_ROWS, on the other."""
    from service.runtime.cpu import cpu_info
    from service.runtime.seq2seq_runner import SMALL_ROWS

    def make(**overrides) -> Engine:
        return Engine(EngineConfig(**{**dict(bundle=seq2seq_int8_bundle, graph=graph, max_running=SMALL_ROWS + 8,
                                             max_batch_tokens=1024, threads=0), **overrides}))

    engine = make()
    assert engine.runner.graph_name == graph and engine.max_running > SMALL_ROWS
    assert (engine.runner.one_thread is not None) == (cpu_info().cores > 1)
    srcs = sources(engine)
    alone = {f"w{i}": drive(make(max_running=1), [greedy(f"w{i}", s, 12)]).events[(f"w{i}", 0)]
             for i, s in enumerate(srcs[:4])}
    crowd = srcs * (SMALL_ROWS // len(srcs) + 1)  # more rows than the one-thread session takes
    every_core = engine.runner.session
    calls = []
    run_on_every_core = every_core.run_with_iobinding
    every_core.run_with_iobinding = lambda *args: calls.append(1) or run_on_every_core(*args)
    run = drive(engine, [greedy(f"w{i}", s, 12) for i, s in enumerate(crowd) if i < 6],
                {3: [greedy(f"w{i}", s, 12) for i, s in enumerate(crowd) if i >= 6]})
    assert len(crowd) > SMALL_ROWS and (calls or cpu_info().cores == 1)  # both sessions ran
    for rid, events in alone.items():
        assert [(e.token_id, e.logprob) for e in run.events[(rid, 0)]] == [(e.token_id, e.logprob) for e in events]


def test_seeded_sampling_n_and_penalties_are_batch_invariant(make_s2s):
    engine = make_s2s()
    srcs = sources(engine)
    req = sampled("s", srcs[0], 10, seed=7, n=2, temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5)
    alone = drive(make_s2s(), [req])
    crowd = drive(engine, [sampled("s", srcs[0], 10, seed=7, n=2, temperature=0.9, repetition_penalty=1.3,
                                   presence_penalty=0.5)] + [greedy(f"o{i}", s, 8) for i, s in enumerate(srcs[1:4])])
    assert [alone.tokens("s", k) for k in (0, 1)] == [crowd.tokens("s", k) for k in (0, 1)]


def test_stop_rules_and_limits(make_s2s):
    engine = make_s2s()
    m = engine.model
    src = sources(engine)[0]
    run = drive(engine, [greedy("g", src, m.n_ctx - 1)])
    full = run.tokens("g")
    assert len(full) <= m.n_ctx - 1  # the target context bounds the output, whatever the source length
    if len(full) >= 3:  # a stop token ends the target at its first occurrence
        stop = full[2]
        cut = drive(engine, [greedy("t", src, m.n_ctx - 1, stop_token_ids=[stop])])
        assert cut.tokens("t") == full[:full.index(stop) + 1] and cut.finish("t") == "stop"
    with pytest.raises(InvalidRequest, match="longest source"):
        engine.new_request(greedy("long", [5] * (m.n_src_ctx + 1), 4))
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        engine.new_request(greedy("many", src, m.n_ctx))
    # a source as long as the model allows, and a target as long as the context allows, together
    longest = GenerationRequest("max", [7] * m.n_src_ctx, SamplingParams(temperature=0.0),
                                StoppingCriteria(max_new_tokens=m.n_ctx - 1, ignore_eos=True))
    run = drive(engine, [longest])
    assert len(run.tokens("max")) == m.n_ctx - 1 and not run.errors


def test_a_truncated_source_keeps_its_last_tokens(make_s2s):
    engine = make_s2s()
    limit = engine.limits.max_prompt_tokens
    long = list(np.arange(limit + 5) % 20 + 4)
    req = GenerationRequest("t", [int(t) for t in long], SamplingParams(temperature=0.0),
                            StoppingCriteria(max_new_tokens=5), truncate_prompt=True)
    state = engine.new_request(req)
    assert state.prompt == [int(t) for t in long[-limit:]]


def test_aborting_one_request_leaves_the_others(make_s2s):
    engine = make_s2s()
    srcs = sources(engine)
    want = drive(make_s2s(), [greedy("keep", srcs[1], 12, ignore_eos=True)]).tokens("keep")

    def abort(engine, step, run):
        if step == 2:
            engine.abort("drop")

    run = drive(engine, [greedy("drop", srcs[0], 12, ignore_eos=True), greedy("keep", srcs[1], 12, ignore_eos=True)],
                before_step=abort)
    assert run.tokens("keep") == want and len(run.tokens("drop")) < 12


def test_greedy_targets_equal_pytorch(seq2seq_model_dir, lively_seq2seq_bundle):
    import torch

    from model.checkpoint import load_seq2seq_dir

    model, _ = load_seq2seq_dir(seq2seq_model_dir)
    engine = Engine(EngineConfig(bundle=lively_seq2seq_bundle, max_running=4, max_batch_tokens=64, threads=1))
    srcs = sources(engine)
    run = drive(engine, [greedy(f"w{i}", s, 15) for i, s in enumerate(srcs)])
    for i, src in enumerate(srcs):
        assert run.tokens(f"w{i}") == model.generate(torch.tensor([src]), max_new_tokens=15)[0]


def test_a_deadline_ends_a_running_request_and_frees_its_slots(make_s2s):
    engine = make_s2s()
    srcs = sources(engine)
    want = drive(make_s2s(), [greedy("keep", srcs[1], 12, ignore_eos=True)]).tokens("keep")
    late = sampled("late", srcs[0], 12, seed=3, n=2, stopping={"ignore_eos": True})
    soon = time.monotonic() + 1000
    late.deadline = soon
    run = Run()
    for r in (late, greedy("keep", srcs[1], 12, ignore_eos=True)):
        engine.add(engine.new_request(r))
    for _ in range(3):
        run.collect(engine.step())
    free = engine.kv.free_slots
    out = engine.expire(now=soon + 1)
    assert [(s.id, type(e)) for s, e in out] == [("late", DeadlineExceeded)]
    assert engine.kv.free_slots == free + 2
    engine.generate(on_outputs=run.collect)
    check_idle(engine)
    assert run.tokens("keep") == want


def test_max_source_tokens_sizes_each_slots_source_state_and_keeps_outputs(make_s2s, engine_bundle):
    full = make_s2s()
    srcs = sources(full)
    width = max(len(s) for s in srcs)
    small = make_s2s(max_source_tokens=width)
    state_bytes = [sum(a.nbytes for a in e.kv.slot_state) for e in (small, full)]
    assert state_bytes[0] < state_bytes[1] and small.limits.max_prompt_tokens == width
    requests = [greedy(f"w{i}", s, 12) for i, s in enumerate(srcs)]
    a, b = drive(full, requests), drive(small, [greedy(f"w{i}", s, 12) for i, s in enumerate(srcs)])
    for i in range(len(srcs)):  # the same tokens; logprobs to rounding: the attention sums fewer masked positions
        assert a.tokens(f"w{i}") == b.tokens(f"w{i}")
        assert [e.logprob for e in a.events[(f"w{i}", 0)]] == pytest.approx(
            [e.logprob for e in b.events[(f"w{i}", 0)]], abs=1e-5)
    with pytest.raises(InvalidRequest, match="prompt"):
        small.new_request(greedy("long", srcs[0] * (width // len(srcs[0]) + 1), 4))
    from service.runtime.bundle import BundleError

    with pytest.raises(BundleError, match="encoder-decoders"):
        Engine(EngineConfig(bundle=engine_bundle, max_source_tokens=8, threads=1))
