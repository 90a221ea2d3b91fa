"""The OpenAI-compatible HTTP front, driven by the real `openai` client against a live server that also
serves gRPC: what HTTP returns equals what gRPC returns for the same request (the same engine), in
OpenAI's shapes, streamed or whole; chat through the model's template; and every error in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test tool of the HTTP front")
httpx2 = pytest.importorskip("httpx2")

from service.client import Client  # noqa: E402
from service.runtime.bundle import read_manifest  # noqa: E402
from tests.fronts.server_harness import (  # noqa: E402
    ServerThread,
    engine_for,
    free_port,
    settings,
    slowed,
    templated_server,
    wait_until,
)

PROMPT = "Rom.\nBut soft"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def oai(srv: ServerThread, key: str = "unused", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.http_url + "/v1", api_key=key, max_retries=0, timeout=60, **options)


@pytest.fixture(scope="module")
def api(server):
    with oai(server) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return read_manifest(server.settings.bundle[0]).model.name


def grpc_text(client: Client, prompt, **fields) -> list[str]:
    return [c.text for c in client.generate(prompt, **fields).completions]


# ---- completions ---------------------------------------------------------------------------------

def test_models_lists_the_bundle_name(api, model_name, server):
    models = api.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert api.models.retrieve(model_name).id == model_name
    assert models.data[0].max_model_len == read_manifest(server.settings.bundle[0]).model.n_ctx


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=7),
                                      dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, seed=3)])
def test_http_tokens_equal_grpc_tokens(api, client, model_name, sampling):
    out = api.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, logprobs=0, **sampling)
    grpc = client.generate(PROMPT, max_new_tokens=12, logprobs=True, **sampling).completions[0]
    assert out.choices[0].text == grpc.text
    assert out.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in grpc.logprobs], abs=1e-5)
    assert out.usage.completion_tokens == len(grpc.token_ids) and out.usage.prompt_tokens == grpc_prompt_tokens(
        client, PROMPT)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == model_name


def grpc_prompt_tokens(client: Client, prompt: str) -> int:
    return len(client.tokenize(prompt).token_ids)


def test_vllm_extensions_equal_grpc(api, client):
    extra = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, min_tokens=6, ignore_eos=True)
    out = api.completions.create(model="", prompt=PROMPT, max_tokens=8, seed=11, extra_body=extra)
    grpc = grpc_text(client, PROMPT, max_new_tokens=8, seed=11, top_k=5, min_p=0.05, repetition_penalty=1.3,
                     min_new_tokens=6, ignore_eos=True)
    assert out.choices[0].text == grpc[0] and out.usage.completion_tokens == 8


def test_a_stream_adds_up_to_the_whole_response(api, model_name):
    whole = api.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, seed=5, temperature=0.9)
    chunks = list(api.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, seed=5, temperature=0.9,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stream_ends_with_done(server):
    with httpx2.Client(base_url=server.http_url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_n_and_a_list_of_prompts_number_the_choices_as_openai(api, client):
    prompts = [PROMPT, "Ham.\nTo be"]
    out = api.completions.create(model="", prompt=prompts, max_tokens=6, n=2, seed=9, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        assert [c.text for c in out.choices[2 * p: 2 * p + 2]] == grpc_text(client, prompt, max_new_tokens=6, n=2,
                                                                              seed=9, temperature=1.0)
    assert out.usage.completion_tokens == 24


def test_a_prompt_of_token_ids_equals_its_text(api, client):
    ids = list(client.tokenize(PROMPT).token_ids)
    by_ids = api.completions.create(model="", prompt=ids, max_tokens=8, temperature=0)
    by_text = api.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batched = api.completions.create(model="", prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(batched.choices) == 2 and batched.choices[0].text == by_ids.choices[0].text[:len(
        batched.choices[0].text)]


def test_logprobs_have_openai_completion_shape(api):
    out = api.completions.create(model="", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    whole = [t for t in lp.tokens if not t.startswith("bytes:")]  # tokens that are whole characters
    assert all(t in out.choices[0].text for t in whole)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token in top and top[token] == pytest.approx(value) and 3 <= len(top) <= 4
        assert value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: the chosen is the likeliest
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_a_stop_string_ends_the_text_before_it(api):
    free = api.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free[6:8]
    assert len(stop) == 2, free
    stopped = api.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert stopped.choices[0].text == free[:free.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_its_completion(api):
    runs = [api.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=s).choices[0].text
            for s in (42, 42, 43)]
    assert runs[0] == runs[1] != runs[2]


def test_echo_puts_the_prompt_first(api):
    plain = api.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = api.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = api.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_the_request_id_is_the_clients_and_comes_back(server):
    r = raw(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "abc-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
    assert raw(server, "POST", "/v1/completions", {"prompt": PROMPT}).headers["x-request-id"]  # one is assigned


def test_connections_send_small_chunks_at_once(server):
    """TCP_NODELAY on every accepted connection: otherwise a stream's chunks wait for the client's
    delayed acknowledgement."""
    import socket

    async def nodelay() -> list[int]:
        connections = server.server.http._server.server_state.connections
        return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for c in connections]

    with httpx2.Client(base_url=server.http_url, timeout=60) as h:
        assert h.get("/health").status_code == 200  # the connection stays open (keep-alive)
        flags = server.call(nodelay())
    assert flags and all(flags)


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(api, client):
    rng = np.random.default_rng(17)
    prefix = rng.integers(1, 60, 40).tolist()  # 40 tokens: two whole blocks of 16 once cached
    first = api.completions.create(model="", prompt=prefix + [3], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = api.completions.create(model="", prompt=prefix + [5, 6], max_tokens=2)
    assert again.usage.prompt_tokens == 42 and again.usage.prompt_tokens_details.cached_tokens == 32
    streamed = api.completions.create(model="", prompt=prefix + [7], max_tokens=2, stream=True,
                                      stream_options={"include_usage": True})
    assert list(streamed)[-1].usage.prompt_tokens_details.cached_tokens == 32
    usage = client.generate(prefix + [8], max_new_tokens=2).usage
    assert usage.prompt_tokens == 41 and usage.cached_prompt_tokens == 32


def test_metrics_count_http_calls_by_protocol(api, server):
    before = server.server.metrics.requests.labels("http", "/v1/completions", "200")._value.get()
    api.completions.create(model="", prompt=PROMPT, max_tokens=2)
    assert server.server.metrics.requests.labels("http", "/v1/completions", "200")._value.get() == before + 1


def test_32_concurrent_streams_through_async_openai(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            async def one(i: int) -> str:
                chunks = await c.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=i,
                                                    stream=True)
                return "".join([ch.choices[0].text async for ch in chunks])

            together = await asyncio.gather(*(one(i) for i in range(32)), return_exceptions=True)
            alone = [await one(i) for i in range(0, 32, 8)]
            return together, alone

    together, alone = asyncio.run(main())
    assert [t for t in together if isinstance(t, BaseException)] == []
    assert [together[i] for i in range(0, 32, 8)] == alone  # batched with 31 others or alone: the same text


# ---- chat ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_server(engine_bundle, tmp_path_factory):
    """The engine bundle with a ChatML template."""
    with templated_server(engine_bundle, tmp_path_factory.mktemp("chat"), CHATML) as srv:
        yield srv


MESSAGES = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who art thou?"}]


def rendered(messages) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def test_chat_renders_the_template_and_equals_a_completion_of_it(chat_server):
    with oai(chat_server) as api, Client(chat_server.address) as grpc:
        ids = list(grpc.tokenize(rendered(MESSAGES)).token_ids)
        chat = api.chat.completions.create(model="", messages=MESSAGES, max_tokens=10, temperature=0.7, seed=2)
        plain = grpc.generate(ids, max_new_tokens=10, temperature=0.7, seed=2).completions[0]
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.text
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == len(plain.token_ids)


def test_chat_streams_the_role_then_content_then_the_finish_reason(chat_server):
    with oai(chat_server) as api:
        whole = api.chat.completions.create(model="", messages=MESSAGES, max_tokens=10, temperature=0, n=2,
                                            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        chunks = list(api.chat.completions.create(model="", messages=MESSAGES, max_tokens=10, temperature=0, n=2,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[index].message.content
        assert mine[-1].finish_reason == whole.choices[index].finish_reason is not None
        assert all(c.finish_reason is None for c in mine[:-1])
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens // 2
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == whole.choices[0].message.content


def test_chat_without_a_template_is_a_400_that_says_so(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])
    assert "chat template" in e.value.body["message"] and e.value.body["param"] == "messages"



@pytest.mark.parametrize("max_tokens,param", [("context", "max_tokens"), ("room + 1", "prompt")])
def test_max_tokens_past_the_context_says_the_prompt_the_max_tokens_and_the_context(api, engine_model, max_tokens,
                                                                                     param):
    """LangChain's OpenAI class asks for 256 on a context of 256: the 400 says the limit is the context less the
    prompt, in OpenAI's error shape, whether max_tokens alone is too large or only with the prompt."""
    n_ctx = engine_model.n_ctx
    asked = n_ctx if max_tokens == "context" else n_ctx - 4
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="", prompt=[5] * 5, max_tokens=asked)
    error = e.value.body
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert f"prompt 5 tokens + max_tokens {asked} exceed the context of {n_ctx}; lower max_tokens to at most " \
           f"{n_ctx - 5}" in error["message"], error
    assert "max_new_tokens" not in error["message"]
    assert api.completions.create(model="", prompt=[5] * 5, max_tokens=n_ctx - 5).usage.prompt_tokens == 5


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_past_the_context_names_the_field_the_client_sent(chat_server, engine_model, field):
    n_ctx = engine_model.n_ctx
    with oai(chat_server) as api, Client(chat_server.address) as grpc:
        prompt = len(grpc.tokenize(rendered(MESSAGES)).token_ids)
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model="", messages=MESSAGES, **{field: n_ctx})
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == field
    assert f"prompt {prompt} tokens + {field} {n_ctx} exceed the context of {n_ctx}" in error["message"], error

# ---- errors --------------------------------------------------------------------------------------

def raw(srv: ServerThread, method: str, path: str, body=None, **kwargs) -> httpx2.Response:
    content = body if isinstance(body, bytes | str) or body is None or hasattr(body, "__next__") else json.dumps(body)
    with httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        return h.request(method, path, content=content, **kwargs)


def error_of(response: httpx2.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "logprobs": 99}, "logprobs"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": PROMPT * 40, "max_tokens": 120}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "suffix": "end"}, "suffix"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"prompt": PROMPT, "logit_bias": {"five": 1}}, "logit_bias.five"),
    ({"prompt": PROMPT, "priority": 2**31}, "priority"),
    ({"prompt": PROMPT, "timeout": -2}, "timeout"),
    ([1, 2], "body"),
])
def test_an_invalid_field_is_a_400_naming_it(server, body, param):
    r = raw(server, "POST", "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param + ":"), error
    assert "max_new_tokens" not in error["message"] and "prompt_token_ids" not in error["message"], error


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_an_invalid_chat_field_is_a_400_naming_it(server, body, param):
    r = raw(server, "POST", "/v1/chat/completions", body)
    assert r.status_code == 400 and error_of(r)["param"] == param, r.text


def test_malformed_json_unknown_model_unknown_path_and_method(server, api):
    r = raw(server, "POST", "/v1/completions", b"{not json")
    assert r.status_code == 400 and error_of(r)["param"] == "body"
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]
    assert raw(server, "GET", "/v1/models/gpt-4").status_code == 404
    r = raw(server, "GET", "/v1/nothing")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
    r = raw(server, "GET", "/v1/completions")
    assert r.status_code == 405 and error_of(r)["message"].startswith("GET /v1/completions")


def test_an_oversized_body_is_a_413(server):
    big = {"prompt": "x" * (server.settings.max_receive_message_bytes + 10)}
    r = raw(server, "POST", "/v1/completions", big)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    chunked = raw(server, "POST", "/v1/completions", iter([b'{"prompt": "', b"y" * 2**20] * 5))  # no length given
    assert chunked.status_code == 413


def test_the_bearer_token_guards_http_but_not_health(engine_bundle):
    with ServerThread(settings(engine_bundle, http_port=free_port(), auth_token="s3cret")) as srv:
        with oai(srv, key="wrong") as api:
            with pytest.raises(openai.AuthenticationError) as e:
                api.completions.create(model="", prompt=PROMPT, max_tokens=2)
            assert e.value.body["type"] == "authentication_error"
        missing = raw(srv, "POST", "/v1/completions", {"prompt": PROMPT})
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert error_of(missing)["code"] == "invalid_api_key"
        with oai(srv, key="s3cret") as api:
            assert api.completions.create(model="", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert raw(srv, "GET", "/health").status_code == 200
        assert raw(srv, "GET", "/v1/models").status_code == 401
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            before = srv.server.metrics.requests.labels("http", path, "401")._value.get()
            assert raw(srv, "POST", path, body).status_code == 401
            assert srv.server.metrics.requests.labels("http", path, "401")._value.get() == before + 1
            assert raw(srv, "POST", path, body, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_overload_is_a_429_with_retry_after(engine_bundle):
    s = settings(engine_bundle, http_port=free_port(), max_running=1, max_waiting=0, max_batch_tokens=64, warmup=False)
    with ServerThread(s, engine=engine_for(s, slowed(0.05))) as srv, oai(srv) as api:
        holder = api.completions.create(model="", prompt=PROMPT, max_tokens=60, stream=True, extra_body={
            "min_tokens": 60})
        next(iter(holder))  # the one slot is taken
        r = raw(srv, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert error_of(r)["type"] == "rate_limit_error"
        holder.close()


def test_a_timeout_becomes_the_engine_deadline(engine_bundle):
    s = settings(engine_bundle, http_port=free_port(), warmup=False)
    with ServerThread(s, engine=engine_for(s, slowed(0.05))) as srv:
        r = raw(srv, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 100, "min_tokens": 100,
                                                 "timeout": 0.3})
        assert r.status_code == 408 and error_of(r)["type"] == "timeout_error"
        r = raw(srv, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 100, "min_tokens": 100},
                headers={"X-Request-Timeout": "0.3"})
        assert r.status_code == 408
        wait_until(lambda: srv.server.engine.stats().running_requests == 0, 5, "the slots to be free")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(engine_bundle, stream):
    s = settings(engine_bundle, http_port=free_port(), warmup=False)
    with ServerThread(s, engine=engine_for(s, slowed(0.05))) as srv:
        body = {"prompt": PROMPT, "max_tokens": 100, "min_tokens": 100, "stream": stream}
        with httpx2.Client(base_url=srv.http_url, timeout=0.5) as h:
            if stream:
                with h.stream("POST", "/v1/completions", json=body) as r:
                    next(r.iter_lines())
            else:
                with pytest.raises(httpx2.ReadTimeout):
                    h.post("/v1/completions", json=body)
        # the engine frees the slot, the front leaves the in-flight count and counts the 499 as each gets to it
        # (a stream's slot can be free before the response's cleanup has run): each is waited for
        gone = srv.server.metrics.requests.labels("http", "/v1/completions", "499")
        wait_until(lambda: srv.server.engine.stats().running_requests == 0, what="the slot to be free")
        wait_until(lambda: srv.server.serving.active == 0, what="the call to leave the in-flight count")
        wait_until(lambda: gone._value.get() == 1, what="the disconnect to be counted as a 499")


def test_503_while_loading_then_200_then_503_while_draining(engine_bundle):
    s = settings(engine_bundle, http_port=free_port(), warmup=True)
    warming = threading.Event()  # the warm-up waits for it: the server is loading until the test says

    def held(engine) -> None:
        slowed(0.02)(engine)
        warm_up = engine.warm_up
        engine.warm_up = lambda: (warming.wait(60), warm_up())

    srv = ServerThread(s, engine=engine_for(s, held), start=False)
    try:
        starting = srv.start_async()
        wait_until(lambda: srv.server.http_port, 10, "the HTTP port")
        health = raw(srv, "GET", "/health")
        r = raw(srv, "POST", "/v1/completions", {"prompt": PROMPT})
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert list(health.json()["models"].values()) == ["loading"]
        assert r.status_code == 503 and error_of(r)["type"] == "service_unavailable"
        warming.set()
        starting.result(60)
        assert raw(srv, "GET", "/health").status_code == 200
        with httpx2.Client(base_url=srv.http_url, timeout=60) as h, h.stream(
                "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "min_tokens": 40,
                                                 "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            drained = srv.drain(30)
            wait_until(lambda: not srv.server.serving.accepting, 5, "draining")
            assert raw(srv, "GET", "/health").status_code == 503
            assert raw(srv, "POST", "/v1/completions", {"prompt": PROMPT}).status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]  # the stream in flight finished
        drained.result(30)
    finally:
        srv.close()


def test_the_server_never_answers_500_to_a_client_mistake(server):
    """A few bodies of every JSON type in every field: 200 or 4xx, never 5xx (the fuzz test goes further)."""
    values = [None, True, -1, 0, 1.5, 1e308, "", "x", [], [1], {}, {"a": 1}]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "echo", "stop", "seed",
              "stream_options", "top_k", "min_p", "stop_token_ids", "user", "timeout", "model"]
    for field in fields:
        for value in values:
            body = {"prompt": PROMPT, "max_tokens": 2, field: value}
            r = raw(server, "POST", "/v1/completions", body)
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                error_of(r)


def test_a_shorter_served_context_is_reported_and_enforced_on_both_fronts(engine_bundle):
    with ServerThread(settings(engine_bundle, http_port=free_port(), max_context=40)) as srv, \
            oai(srv) as api, Client(srv.address, timeout_s=60) as grpc_client:
        assert api.models.list().data[0].max_model_len == 40
        assert grpc_client.model_info().context_tokens == 40
        info = grpc_client.server_info()  # the budget's tokens, all free (nothing ran yet)
        assert info.kv_tokens >= 40 and info.kv_free_tokens == info.kv_tokens
        ok = api.completions.create(model="", prompt=[1, 2, 3], max_tokens=37, temperature=0)
        assert ok.usage.completion_tokens <= 37
        with pytest.raises(openai.BadRequestError, match="40"):
            api.completions.create(model="", prompt=[1, 2, 3], max_tokens=38)
