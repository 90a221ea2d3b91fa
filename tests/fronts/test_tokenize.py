"""/tokenize and /detokenize against a live server: a text's ids are the tokenizer's and decode back to it; a
chat's count is the usage.prompt_tokens of the same chat request (one rendering, with tools, template
variables and continue_final_message); bad input is a 400 in OpenAI's shape naming the field; the bearer
token guards both."""

from __future__ import annotations

import pytest

from service.runtime.chat_template import ChatTemplate
from service.runtime.tokenizer import Tokenizer
from tests.fronts.server_harness import ServerThread, free_port, settings, templated_server
from tests.fronts.test_http_api import CHATML, error_of, raw

MESSAGES = [{"role": "user", "content": "Rain?"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]  # short: the tiny model's context is short
TOOL_TEMPLATE = CHATML.replace("{% for message", "{% if tools %}{{ '<|im_start|>tools\n' + (tools | tojson) "
                               "+ '<|im_end|>\n' }}{% endif %}{% for message")


@pytest.fixture(scope="module")
def server(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("tokenize"), TOOL_TEMPLATE) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(engine_bundle) -> Tokenizer:
    return Tokenizer.from_file(engine_bundle / "tokenizer.json", eos_id=0)  # encoding and names only


def ok(srv, path: str, body: dict) -> dict:
    r = raw(srv, "POST", path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_text_is_tokenized_as_the_tokenizer_does_and_decodes_back(server, tokenizer):
    text = "Rom.\nBut soft, what light"
    answer = ok(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert answer["tokens"] == tokenizer.encode(text) and answer["count"] == len(answer["tokens"]) > 0
    assert answer["max_model_len"] == raw(server, "GET", "/v1/models").json()["data"][0]["max_model_len"]
    assert answer["token_strs"] == [tokenizer.hf.id_to_token(t) for t in answer["tokens"]]
    assert "token_strs" not in ok(server, "/tokenize", {"prompt": text})
    assert ok(server, "/detokenize", {"tokens": answer["tokens"]}) == {"prompt": text}
    completion = ok(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == answer["count"]


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"chat_template_kwargs": {"enable_thinking": False}},
                                   {"add_generation_prompt": False}])
def test_a_chats_count_is_the_prompt_tokens_of_the_same_chat_request(server, tokenizer, extra):
    answer = ok(server, "/tokenize", {"messages": MESSAGES, **extra})
    chat = ok(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **extra})
    assert answer["count"] == chat["usage"]["prompt_tokens"] == len(answer["tokens"])
    text = ok(server, "/detokenize", {"tokens": answer["tokens"]})["prompt"]
    assert text.startswith("<|im_start|>tools\n") == ("tools" in extra)
    assert text.endswith("<|im_start|>assistant\n") == extra.get("add_generation_prompt", True)
    with_special = ok(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True, **extra})
    assert with_special["tokens"] == tokenizer.encode(text, add_special_tokens=True)


def test_continue_final_message_ends_the_prompt_inside_the_last_message(server):
    messages = [*MESSAGES, {"role": "assistant", "content": "It will "}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    answer = ok(server, "/tokenize", body)
    text = ok(server, "/detokenize", {"tokens": answer["tokens"]})["prompt"]
    assert text.endswith("<|im_start|>assistant\nIt will ")  # the template's <|im_end|> cut off
    chat = ok(server, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == answer["count"]
    closed = ok(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert closed["count"] > answer["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": MESSAGES, "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = raw(server, "POST", path, body)
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param), error
    if param == "add_generation_prompt":
        assert "goes with messages" in error["message"]


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})])
def test_another_models_name_is_refused_as_on_every_endpoint(server, path, body):
    r = raw(server, "POST", path, {**body, "model": "gpt-4"})
    assert r.status_code == 404 and error_of(r)["param"] == "model"
    assert ok(server, path, {**body, "model": ""})


def test_a_model_that_cannot_chat_still_tokenizes_text(engine_bundle):
    if ChatTemplate.from_bundle(engine_bundle) is not None:
        pytest.skip("the bundle under test has a chat template")
    with ServerThread(settings(engine_bundle, http_port=free_port())) as srv:
        assert ok(srv, "/tokenize", {"prompt": "x"})["count"] >= 1
        r = raw(srv, "POST", "/tokenize", {"messages": MESSAGES})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"
