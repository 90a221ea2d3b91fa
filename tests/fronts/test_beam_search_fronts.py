"""Beam search over both fronts: gRPC's beam_width and vLLM's use_beam_search on HTTP give the engine's
hypotheses and scores; fields that do not apply to it are 400 / INVALID_ARGUMENT naming them."""

from __future__ import annotations

import grpc
import openai
import pytest

from attnserve.v1 import generate_pb2 as pb
from service.client import Client
from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.engine.request import BeamParams, GenerationRequest, SamplingParams, StoppingCriteria
from tests.engine.harness import drive
from tests.fronts.server_harness import ServerThread, free_port, settings
from tests.fronts.test_http_api import oai

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def srv(engine_bundle):
    with ServerThread(settings(engine_bundle, graph="static", http_port=free_port())) as s:
        yield s


def engine_beams(bundle, width: int, n: int, max_new: int, length_penalty: float = 1.0):
    engine = Engine(EngineConfig(bundle=bundle, graph="static", max_running=8, max_batch_tokens=64, threads=1))
    r = GenerationRequest("b", PROMPT, SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=max_new), n=n,
                          beam=BeamParams(width, length_penalty))
    run = drive(engine, [r])
    return [(run.tokens("b", j), run.events[("b", j)][-1].beam_score) for j in range(n)]


def test_grpc_and_http_return_the_engines_best_hypotheses_with_their_scores(srv, engine_bundle):
    want = engine_beams(engine_bundle, 4, 2, 12, 0.5)
    with Client(srv.address, timeout_s=60) as client:
        response = client.generate(PROMPT, beam_width=4, n=2, max_new_tokens=12, length_penalty=0.5)
    assert [list(c.token_ids) for c in response.completions] == [t for t, _ in want]
    assert [c.beam_score for c in response.completions] == pytest.approx([s for _, s in want], abs=1e-5)
    with oai(srv) as api:
        answer = api.post("/completions", body={"prompt": PROMPT, "max_tokens": 12, "n": 2, "use_beam_search": True,
                                                "best_of": 4, "length_penalty": 0.5, "temperature": 0}, cast_to=object)
    texts = [c.text for c in response.completions]
    assert [c["text"] for c in answer["choices"]] == texts
    assert [c["beam_score"] for c in answer["choices"]] == pytest.approx([s for _, s in want], abs=1e-5)


@pytest.mark.parametrize(("extra", "param"), [({"temperature": 0.7}, "temperature"), ({"best_of": 1}, "best_of"),
                                               ({"top_k": 5}, "top_k"), ({"logprobs": 1}, "logprobs"),
                                               ({"stop": ["x"]}, "stop")])
def test_http_refuses_what_beam_search_does_not_use(srv, extra, param):
    with oai(srv) as api, pytest.raises(openai.BadRequestError) as e:
        api.post("/completions", body={"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, "n": 2, **extra},
                 cast_to=object)
    assert e.value.body["param"] == param


def test_grpc_refuses_beam_fields_without_a_width_and_a_width_past_the_engine(srv):
    with Client(srv.address, timeout_s=60) as client:
        for fields, name in (({"length_penalty": 2.0}, "length_penalty"), ({"beam_width": 1}, "beam_width"),
                             ({"beam_width": 4, "n": 5}, "n")):
            with pytest.raises(grpc.RpcError) as e:
                client.generate(PROMPT, max_new_tokens=4, **fields)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and name in e.value.details(), fields
    assert pb.BEAM_STOPPING_NEVER == 2
