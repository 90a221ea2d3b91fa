"""Prompt logprobs through both fronts, on the shared live server: /v1/completions with `echo` and `logprobs`
(OpenAI's shape, through the `openai` client, whole and streamed; `max_tokens: 0`; the request
lm-evaluation-harness's `local-completions` sends), and gRPC's `prompt_logprobs`. Their values are the
model's: a log-softmax of the serving graph's logits over the whole prompt."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test tool of the HTTP front")

from tests.engine.test_prompt_logprobs import graph_logprobs  # noqa: E402
from tests.fronts.test_http_api import PROMPT, oai, raw  # noqa: E402


@pytest.fixture(scope="module")
def api(server):
    with oai(server) as c:
        yield c


@pytest.fixture(scope="module")
def prompt_ids(client) -> list[int]:
    return list(client.tokenize(PROMPT).token_ids)


def test_echo_with_logprobs_returns_the_prompts_tokens_then_the_generated_ones(api, client, server, prompt_ids):
    out = api.completions.create(model="", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    grpc = client.generate(PROMPT, max_new_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                           prompt_logprobs=2)
    n = len(prompt_ids)
    assert out.choices[0].text.startswith(PROMPT) and len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n] == len(PROMPT)
    want = graph_logprobs(server.settings.bundle[0], prompt_ids)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, prompt_ids[i]], abs=1e-5)
        assert lp.tokens[i] in lp.top_logprobs[i] and 2 <= len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(want[i - 1].max(), abs=1e-5)
    # gRPC gives the same numbers: the prompt's after its first token, and the generated ones
    assert [p.token_id for p in grpc.prompt_logprobs] == prompt_ids[1:]
    assert [p.logprob for p in grpc.prompt_logprobs] == pytest.approx(lp.token_logprobs[1:n], abs=1e-6)
    assert all(len(p.top) == 2 for p in grpc.prompt_logprobs)
    assert [p.logprob for p in grpc.completions[0].logprobs] == pytest.approx(lp.token_logprobs[n:], abs=1e-6)

    # streamed: the prompt's part in the first chunk, and the same whole
    chunks = list(api.completions.create(model="", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                         logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT) and len(chunks[0].choices[0].logprobs.tokens) >= n + 1
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    first = next(client.stream_responses(PROMPT, max_new_tokens=3, temperature=0, prompt_logprobs=0))
    assert [p.logprob for p in first.prompt_logprobs] == pytest.approx(lp.token_logprobs[1:n], abs=1e-6)


def test_max_tokens_0_with_echo_returns_the_prompt_alone(api, prompt_ids):
    out = api.completions.create(model="", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids) and out.usage.completion_tokens == 0
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])  # the token itself, as OpenAI gives it


def test_the_request_lm_eval_sends_scores_each_prompt(server, prompt_ids):
    """local-completions' loglikelihood request: token-id prompts, max_tokens 1, logprobs 1, echo."""
    prompts = [prompt_ids * 4, prompt_ids[:3] + prompt_ids]  # the first is long enough for the prefix cache
    r = raw(server, "POST", "/v1/completions", {"model": "", "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                                "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, prompt in zip(choices, prompts, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    # the same prompt's logprobs again, though the prefix cache now holds it (the last token is sampled)
    again = raw(server, "POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 1, "logprobs": 1,
                                                    "echo": True}).json()
    assert again["choices"][0]["logprobs"]["token_logprobs"][:-1] == choices[0]["logprobs"]["token_logprobs"][:-1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = raw(server, "POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # it was there to be found


def test_grpc_refuses_out_of_range(client):
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        client.generate(PROMPT, max_new_tokens=1, prompt_logprobs=21)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()
