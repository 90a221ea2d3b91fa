"""llama.cpp's `timings` on HTTP responses: on every whole completion and chat completion, and on the last
chunk before [DONE] of a stream (the usage chunk with include_usage); its counts agree with `usage`
(prompt_n = prompt tokens - cached, cache_n = cached, predicted_n = completion tokens) and its times and
rates are non-negative numbers. Timing values themselves are not asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.fronts.server_harness import templated_server
from tests.fronts.test_http_api import CHATML, raw

KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
        "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
MESSAGES = [{"role": "user", "content": "Rain today?"}]


@pytest.fixture(scope="module")
def server(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("timings"), CHATML) as srv:
        yield srv


def post(srv, path: str, body: dict) -> dict:
    r = raw(srv, "POST", path, body)
    assert r.status_code == 200, r.text
    return r.json()


def chunks(srv, path: str, body: dict) -> list[dict]:
    r = raw(srv, "POST", path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def check(timings: dict, usage: dict) -> None:
    """`timings` agrees with `usage`, and its times and rates are non-negative."""
    assert set(timings) == KEYS, timings
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["cache_n"] == cached
    assert timings["prompt_n"] == usage["prompt_tokens"] - cached
    assert timings["predicted_n"] == usage["completion_tokens"]
    for key in KEYS - {"cache_n", "prompt_n", "predicted_n"}:
        assert isinstance(timings[key], int | float) and timings[key] >= 0, (key, timings)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["To be, or", "not to be"], "n": 2, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
])
def test_a_whole_response_has_timings_that_agree_with_its_usage(server, path, body):
    answer = post(server, path, {**body, "ignore_eos": True})
    check(answer["timings"], answer["usage"])
    assert answer["timings"]["predicted_n"] == 4 * len(answer["choices"])


def test_prompt_tokens_from_the_prefix_cache_are_not_computed(server):
    prefix = np.random.default_rng(5).integers(1, 60, 40).tolist()  # two whole blocks of 16 once cached
    post(server, "/v1/completions", {"prompt": prefix + [3], "max_tokens": 2})
    again = post(server, "/v1/completions", {"prompt": prefix + [5, 6], "max_tokens": 2})
    assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    check(again["timings"], again["usage"])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "To be, or", "n": 2, "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5}),
])
def test_a_stream_sends_timings_on_its_last_chunk(server, path, body):
    body = {**body, "ignore_eos": True}
    plain = chunks(server, path, body)
    assert [i for i, c in enumerate(plain) if "timings" in c] == [len(plain) - 1]
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    whole = post(server, path, body)
    assert plain[-1]["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]
    assert plain[-1]["timings"]["prompt_n"] + plain[-1]["timings"]["cache_n"] == whole["usage"]["prompt_tokens"]
    with_usage = chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert [i for i, c in enumerate(with_usage) if "timings" in c] == [len(with_usage) - 1]
    assert with_usage[-1]["choices"] == []
    check(with_usage[-1]["timings"], with_usage[-1]["usage"])
