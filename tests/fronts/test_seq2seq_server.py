"""A server on an encoder-decoder bundle: gRPC and the OpenAI-compatible HTTP front take the prompt as the
source and return the target; GetModelInfo says which kind of model it is; chat and prompt logprobs are
refused."""

from __future__ import annotations

import grpc
import pytest

from service.client import Client
from service.runtime.bundle import read_manifest
from tests.fronts.server_harness import ServerThread, free_port, settings

openai = pytest.importorskip("openai", reason="the openai client is a test tool of the HTTP front")

WORD = "transformer"


@pytest.fixture(scope="module")
def s2s_server(seq2seq_bundle):
    with ServerThread(settings(seq2seq_bundle, http_port=free_port(), graph="auto")) as srv:
        yield srv


def test_model_info_says_encoder_decoder(s2s_server, seq2seq_bundle):
    m = read_manifest(seq2seq_bundle).model
    with Client(s2s_server.address) as c:
        info = c.model_info()
    assert info.kind == "encoder-decoder" and info.encoder_layers == m.n_encoder_layer and info.layers == m.n_layer
    assert info.source_tokens == m.n_src_ctx and info.context_tokens == m.n_ctx
    assert info.decoder_start_token_id == m.decoder_start_token_id


def test_grpc_and_http_return_the_same_target(s2s_server):
    with Client(s2s_server.address, timeout_s=60) as c:
        unary = c.generate(WORD, max_new_tokens=12, temperature=0.0)
        streamed = "".join(c.stream(WORD, max_new_tokens=12, temperature=0.0))
        source = list(c.tokenize(WORD).token_ids)
    completion = unary.completions[0]
    assert streamed == completion.text and len(completion.token_ids) >= 1
    assert unary.usage.prompt_tokens == len(source)
    with openai.OpenAI(base_url=s2s_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        out = api.completions.create(model="", prompt=WORD, max_tokens=12, temperature=0)
        assert out.choices[0].text == completion.text and out.usage.prompt_tokens == len(source)
        with pytest.raises(openai.BadRequestError, match="encoder-decoder"):
            api.chat.completions.create(model="", messages=[{"role": "user", "content": WORD}])
        with pytest.raises(openai.BadRequestError, match="longest source"):
            api.completions.create(model="", prompt=[5] * 500, max_tokens=4)


def test_a_source_too_long_is_invalid_and_the_server_serves_on(s2s_server):
    with Client(s2s_server.address, timeout_s=60) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate([5] * 500, max_new_tokens=4)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "longest source" in e.value.details()
        assert c.generate(WORD, max_new_tokens=3, temperature=0.0).completions[0].token_ids


def test_the_models_generation_config_sets_unset_sampling_fields(lively_seq2seq_bundle, tmp_path):
    """A bundle whose generation_config.json says do_sample false decodes greedily unless asked otherwise."""
    import json
    import shutil

    bundle = tmp_path / "greedy"
    shutil.copytree(lively_seq2seq_bundle, bundle)
    (bundle / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    with ServerThread(settings(bundle)) as srv, Client(srv.address, timeout_s=60) as c:
        greedy = c.generate(WORD, max_new_tokens=12, temperature=0.0).completions[0].token_ids
        assert [c.generate(WORD, max_new_tokens=12, seed=s).completions[0].token_ids for s in (1, 2)] == [greedy] * 2
        sampled = {tuple(c.generate(WORD, max_new_tokens=12, temperature=1.0, seed=s).completions[0].token_ids)
                   for s in range(6)}
        assert len(sampled) > 1  # an explicit temperature still samples


def test_prompt_logprobs_are_refused_the_prompt_is_a_source(s2s_server):
    with Client(s2s_server.address, timeout_s=60) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(WORD, max_new_tokens=3, prompt_logprobs=1)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("prompt_logprobs:") and "source" in e.value.details()
    with openai.OpenAI(base_url=s2s_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        with pytest.raises(openai.BadRequestError, match="encoder-decoder") as e:
            api.completions.create(model="", prompt=WORD, max_tokens=3, echo=True, logprobs=1)
        assert e.value.body["param"] == "logprobs"
        assert api.completions.create(model="", prompt=WORD, max_tokens=3, echo=True).choices[0].text.startswith(WORD)
