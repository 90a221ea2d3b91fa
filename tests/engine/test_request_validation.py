"""Bad requests are refused up front with `InvalidRequest` naming the field and range; nothing is queued.

Ranges that do not depend on the model are checked when the parameters are built (`build`, pydantic);
those that do (vocabulary, context, engine limits) when the engine takes the request."""

from __future__ import annotations

import math

import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import (
    BeamParams,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    build,
)
from tests.engine.harness import check_idle, drive, greedy


@pytest.fixture
def engine(make_engine):
    return make_engine()


def request(prompt=(1, 2, 3), sampling=None, stopping=None, **kw) -> GenerationRequest:
    return GenerationRequest("bad", list(prompt), build(SamplingParams, "sampling", sampling or {}),
                             build(StoppingCriteria, "stopping", stopping or {}), **kw)


# entries that depend on the model are functions of (vocab_size, n_ctx), resolved from the engine bundle
BAD = [
    ("sampling.temperature", dict(sampling=dict(temperature=-0.1))),
    ("sampling.temperature", dict(sampling=dict(temperature=math.nan))),
    ("sampling.temperature", dict(sampling=dict(temperature=math.inf))),
    ("sampling.top_p", dict(sampling=dict(top_p=0.0))),
    ("sampling.top_p", dict(sampling=dict(top_p=1.01))),
    ("sampling.top_p", dict(sampling=dict(top_p=math.nan))),
    ("sampling.top_k", dict(sampling=dict(top_k=-1))),
    ("sampling.top_k", lambda vocab, n_ctx: dict(sampling=dict(top_k=vocab + 1))),
    ("sampling.min_p", dict(sampling=dict(min_p=-0.1))),
    ("sampling.min_p", dict(sampling=dict(min_p=1.5))),
    ("sampling.repetition_penalty", dict(sampling=dict(repetition_penalty=0.0))),
    ("sampling.repetition_penalty", dict(sampling=dict(repetition_penalty=-1.0))),
    ("sampling.repetition_penalty", dict(sampling=dict(repetition_penalty=11.0))),
    ("sampling.presence_penalty", dict(sampling=dict(presence_penalty=2.5))),
    ("sampling.presence_penalty", dict(sampling=dict(presence_penalty=-2.5))),
    ("sampling.frequency_penalty", dict(sampling=dict(frequency_penalty=-3.0))),
    ("sampling.frequency_penalty", dict(sampling=dict(frequency_penalty=math.nan))),
    ("sampling.seed", dict(sampling=dict(seed=-1))),
    ("stopping.max_new_tokens", dict(stopping=dict(max_new_tokens=0))),
    ("stopping.max_new_tokens", dict(stopping=dict(max_new_tokens=-5))),
    ("stopping.max_new_tokens", lambda vocab, n_ctx: dict(stopping=dict(max_new_tokens=n_ctx))),
    ("stopping.max_new_tokens", dict(stopping=dict(max_new_tokens=10_000))),
    ("stopping.min_new_tokens", dict(stopping=dict(max_new_tokens=4, min_new_tokens=5))),
    ("stopping.min_new_tokens", dict(stopping=dict(min_new_tokens=-1))),
    ("stopping.stop", dict(stopping=dict(stop=[f"s{i}" for i in range(17)]))),
    ("stopping.stop[1]", dict(stopping=dict(stop=["ok", ""]))),
    ("stopping.stop[0]", dict(stopping=dict(stop=["x" * 257]))),
    ("stopping.stop_token_ids[1]", lambda vocab, n_ctx: dict(stopping=dict(stop_token_ids=[3, vocab]))),
    ("stopping.stop_token_ids[0]", dict(stopping=dict(stop_token_ids=[-1]))),
    ("n", dict(n=0)),
    ("n", dict(n=17)),
    ("n", dict(n=9)),  # more than this engine's max_running (8)
    ("top_logprobs", dict(top_logprobs=-1)),
    ("top_logprobs", dict(top_logprobs=21)),
    ("prompt", dict(prompt=[])),
    ("prompt_token_ids[2]", lambda vocab, n_ctx: dict(prompt=[1, 2, vocab])),
    ("prompt_token_ids[0]", dict(prompt=[-1, 2])),
    ("prompt_token_ids[1]", dict(prompt=[1, 2.0])),
    ("prompt", lambda vocab, n_ctx: dict(prompt=[1] * (n_ctx - 8), stopping=dict(max_new_tokens=9))),
    ("prompt", lambda vocab, n_ctx: dict(prompt=[1] * n_ctx, stopping=dict(max_new_tokens=1))),
    # beam search: its own ranges, and what it would not use refused by name (at temperature 0, which it runs at)
    ("beam.width", dict(beam=BeamParams(1), sampling=dict(temperature=0.0))),
    ("beam.width", dict(beam=BeamParams(17), sampling=dict(temperature=0.0))),
    ("beam.width", dict(beam=BeamParams(9), sampling=dict(temperature=0.0))),  # more than max_running (8)
    ("beam.length_penalty", dict(beam=BeamParams(2, 11.0), sampling=dict(temperature=0.0))),
    ("beam.early_stopping", dict(beam=BeamParams(2, 1.0, "sometimes"), sampling=dict(temperature=0.0))),
    ("n", dict(beam=BeamParams(2), n=3, sampling=dict(temperature=0.0))),
    ("sampling.temperature", dict(beam=BeamParams(2))),  # 1.0, the default: beam search does not sample
    ("sampling.temperature", dict(beam=BeamParams(2), sampling=dict(temperature=0.5))),
    ("sampling.top_k", dict(beam=BeamParams(2), sampling=dict(temperature=0.0, top_k=5))),
    ("stopping.min_new_tokens", dict(beam=BeamParams(2), sampling=dict(temperature=0.0), stopping=dict(min_new_tokens=1))),
    ("logprobs", dict(beam=BeamParams(2), sampling=dict(temperature=0.0), logprobs=True)),
]


@pytest.mark.parametrize("field,req", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_invalid_parameter_names_its_field(engine, engine_model, field, req):
    if callable(req):
        req = req(engine_model.vocab_size, engine_model.n_ctx)
    with pytest.raises(InvalidRequest) as e:
        engine.add(engine.new_request(request(**req)))
    assert e.value.field == field
    assert isinstance(e.value, ValueError) and field in str(e.value)
    check_idle(engine)


def test_limits_are_inclusive(engine, engine_model):
    """The edges of each range are accepted, and such requests run."""
    vocab, n_ctx = engine_model.vocab_size, engine_model.n_ctx
    reqs = [
        GenerationRequest("a", [1] * (n_ctx - 10), SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=10)),
        GenerationRequest("b", [5], SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=n_ctx - 1,
                                                                                        ignore_eos=True)),
        GenerationRequest("c", [vocab - 1, 0], SamplingParams(temperature=100.0, top_p=1.0, top_k=vocab, min_p=1.0,
                                                              repetition_penalty=10.0, presence_penalty=2.0,
                                                              frequency_penalty=-2.0, seed=2**64 - 1),
                          StoppingCriteria(max_new_tokens=4, min_new_tokens=4, stop=[f"s{i}" for i in range(16)],
                                           stop_token_ids=[0, vocab - 1]), n=8, top_logprobs=20),
    ]
    run = drive(engine, reqs)
    assert not run.errors
    assert len(run.tokens("a")) == 10 and len(run.tokens("b")) == n_ctx - 1
    assert all(len(run.tokens("c", i)) == 4 for i in range(8))
    assert all(len(e.top_logprobs) == 20 for i in range(8) for e in run.events[("c", i)])


def test_truncate_prompt_keeps_the_newest_tokens(engine, make_engine, engine_model):
    n_ctx = engine_model.n_ctx
    prompt = list(range(1, n_ctx - 7))  # n_ctx - 8 tokens + 20 new > n_ctx
    with pytest.raises(InvalidRequest):
        engine.new_request(greedy("t", prompt, 20))
    r = greedy("t", prompt, 20, ignore_eos=True)
    r.truncate_prompt = True
    state = engine.new_request(r)
    assert state.prompt == prompt[-(n_ctx - 20):]
    engine.add(state)
    run = drive(engine)
    assert len(run.tokens("t")) == 20 and run.finish("t") is FinishReason.LENGTH
    want = drive(make_engine(), [greedy("t", prompt[-(n_ctx - 20):], 20, ignore_eos=True)])
    assert run.tokens("t") == want.tokens("t")


def test_max_prompt_tokens_and_max_new_tokens_caps(make_engine):
    engine = make_engine(max_prompt_tokens=10, max_new_tokens=5)
    with pytest.raises(InvalidRequest) as e:
        engine.new_request(greedy("p", list(range(1, 12)), 5))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequest) as e:
        engine.new_request(greedy("p", [1, 2], 6))
    assert e.value.field == "stopping.max_new_tokens"
    r = greedy("p", list(range(1, 12)), 5, ignore_eos=True)
    r.truncate_prompt = True
    engine.add(engine.new_request(r))
    assert r.prompt_token_ids == list(range(2, 12))
    assert len(drive(engine).tokens("p")) == 5



# (prompt tokens, max_new_tokens) as functions of the context; the field named; the hint
CONTEXT_ERRORS = [
    (lambda n: (5, n), "stopping.max_new_tokens", lambda n: f"lower max_new_tokens to at most {n - 5}"),
    (lambda n: (5, n - 3), "prompt",
     lambda n: f"lower max_new_tokens to at most {n - 5} or shorten the prompt to at most 3 tokens"),
    (lambda n: (n, 1), "prompt", lambda n: f"shorten the prompt to at most {n - 1} tokens"),
    (lambda n: (n, n), "stopping.max_new_tokens", lambda n: f"together may take at most {n} tokens"),
]


@pytest.mark.parametrize("sizes,field,hint", CONTEXT_ERRORS)
def test_the_context_error_counts_the_prompt_and_max_new_tokens(engine, engine_model, sizes, field, hint):
    n_ctx = engine_model.n_ctx
    prompt, max_new = sizes(n_ctx)
    with pytest.raises(InvalidRequest) as e:
        engine.new_request(greedy("c", [1] * prompt, max_new))
    assert e.value.field == field
    assert f"prompt {prompt} tokens + max_new_tokens {max_new} exceed the context of {n_ctx}; " in str(e.value)
    assert str(e.value).endswith(hint(n_ctx)), str(e.value)


def test_the_servers_own_limits_are_named_as_such(make_engine):
    engine = make_engine(max_prompt_tokens=10, max_new_tokens=5)
    with pytest.raises(InvalidRequest, match=r"stopping.max_new_tokens: 6 is outside \[1, 5\] \(the server's limit\)"):
        engine.new_request(greedy("p", [1, 2], 6))
    with pytest.raises(InvalidRequest, match="prompt: 11 tokens exceed the server's prompt limit of 10 tokens"):
        engine.new_request(greedy("p", list(range(1, 12)), 5))

def test_a_refused_request_does_not_disturb_the_engine(engine, make_engine):
    engine.add(engine.new_request(greedy("ok", [4, 5, 6], 8)))
    engine.step()
    with pytest.raises(InvalidRequest):
        engine.add(engine.new_request(greedy("ok", [4, 5, 6], 8)))  # duplicate id while running
    with pytest.raises(InvalidRequest):
        engine.add(engine.new_request(request(sampling=dict(top_p=0.0))))
    run = drive(engine)
    assert not run.errors and len(run.tokens("ok")) == 7  # the first token came from the step above


@pytest.mark.parametrize("values,message", [
    (dict(temperature=150.0), "sampling.temperature: 150.0 is outside [0.0, 100.0]"),
    (dict(top_p=0.0), "sampling.top_p: 0.0 is outside (0.0, 1.0]"),
    (dict(top_k=-3), "sampling.top_k: -3 is outside [0, inf)"),
    (dict(temperature=math.nan), "sampling.temperature: nan is not a finite number"),
    (dict(seed=2**64), "sampling.seed: 18446744073709551616 is outside [0, 18446744073709551615]"),
])
def test_range_errors_state_the_allowed_range(values, message):
    with pytest.raises(InvalidRequest) as e:
        build(SamplingParams, "sampling", values)
    assert str(e.value) == message


def test_unknown_parameter_is_named():
    with pytest.raises(InvalidRequest) as e:
        build(StoppingCriteria, "stopping", dict(max_tokens=3))
    assert e.value.field == "stopping.max_tokens"


def test_beam_search_takes_a_seed_it_does_not_use(engine):
    """As greedy sampling does: a seed chooses among random draws, and beam search makes none."""
    engine.add(engine.new_request(request(beam=BeamParams(2), sampling=dict(temperature=0.0, seed=3))))
    run = drive(engine)
    assert not run.errors and len(run.tokens("bad", 0)) > 0
