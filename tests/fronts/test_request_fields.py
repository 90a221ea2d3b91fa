"""docs/api.md's tables of HTTP request fields, walked against the endpoints: every field the schemas take
is documented and every documented field is taken; each is accepted with a valid value, the documented
refusals are 400s naming the field, and a field the table does not list is refused by name. The completion
endpoints have one table, /tokenize and /detokenize another."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest

from service.fronts.http.openai_schema import ChatCompletionRequest, CompletionRequest
from service.fronts.http.tokenize import Detokenize, TokenizeChat, TokenizePrompt
from tests.fronts.server_harness import ServerThread, free_port, settings
from tests.fronts.test_http_api import CHATML, error_of, oai, raw

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ENDPOINTS = {"completions": ("/completions", CompletionRequest, {"prompt": [5, 6], "max_tokens": 2}),
             "chat": ("/chat/completions", ChatCompletionRequest,
                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})}

# a valid value of each documented field (with what it needs beside it), sent alone on top of a minimal body
ACCEPTED = {
    "model": {"model": ""}, "prompt": {"prompt": "To be"}, "messages": {"messages": [{"role": "user", "content": "x"}]},
    "max_tokens": {"max_tokens": 3}, "max_completion_tokens": {"max_completion_tokens": 3},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "n": {"n": 2}, "stop": {"stop": ["zz"]},
    "presence_penalty": {"presence_penalty": 0.1}, "frequency_penalty": {"frequency_penalty": 0.1},
    "seed": {"seed": 3}, "stream": {"stream": False},
    "stream_options": {"stream_options": {"include_usage": True, "include_obfuscation": False}},
    "echo": {"echo": True}, "logprobs": {"completions": {"logprobs": 1}, "chat": {"logprobs": True}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "add_generation_prompt": {"add_generation_prompt": True},
    "response_format": {"response_format": {"type": "json_object"}},
    "guided_json": {"guided_json": {"type": "object"}}, "guided_regex": {"guided_regex": "[a-z]"},
    "guided_choice": {"guided_choice": ["a", "b"]}, "guided_grammar": {"guided_grammar": 'start: "x"'},
    "structured_outputs": {"structured_outputs": {"regex": "[0-9]"}},
    "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1}, "repetition_penalty": {"repetition_penalty": 1.1},
    "min_tokens": {"min_tokens": 1}, "ignore_eos": {"ignore_eos": True}, "stop_token_ids": {"stop_token_ids": [3]},
    "timeout": {"timeout": 30}, "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "tool_choice": {"tool_choice": "none"}, "parallel_tool_calls": {"parallel_tool_calls": False},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "continue_final_message": {"continue_final_message": True, "add_generation_prompt": False,
                               "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "So"}]},
    "max_reasoning_chars": {"max_reasoning_chars": 8}, "reasoning_effort": {"reasoning_effort": "low"},
    "verbosity": {"verbosity": "low"},
    "user": {"user": "u1"}, "metadata": {"metadata": {"k": "v"}}, "store": {"store": False},
    "service_tier": {"service_tier": "auto"}, "prompt_cache_key": {"prompt_cache_key": "k"},
    "safety_identifier": {"safety_identifier": "s"}, "modalities": {"modalities": ["text"]},
    "logit_bias": {"logit_bias": {"5": -100, "6": 2.5}}, "priority": {"priority": -3}, "suffix": {"suffix": ""}, "best_of": {"best_of": 1},
    "use_beam_search": {"use_beam_search": True, "n": 2, "temperature": 0},
    "length_penalty": {"use_beam_search": True, "best_of": 2, "length_penalty": 0.5},
    "early_stopping": {"use_beam_search": True, "best_of": 2, "early_stopping": "never"},
}
# the refusals the table documents: a value the server cannot honour, refused naming the field (a map's entry
# by its key)
REFUSED = {
    "tool_choice": "required", "store": True, "modalities": ["audio"], "suffix": "x", "best_of": 2,
    "length_penalty": 2.0, "early_stopping": True, "priority": 2**31, "max_reasoning_chars": 0,
    "continue_final_message": True,
}
REFUSED_ENTRIES = [("logit_bias", {"7": 1, "x": 1}, "logit_bias.x"), ("logit_bias", {"7": 101}, "logit_bias.7"),
                   ("logit_bias", {"100000": 1}, "logit_bias.100000"),
                   ("logit_bias", dict.fromkeys(map(str, range(301)), 1), "logit_bias")]


def documented(header: str = "| field | endpoints | type |", both: tuple[str, str] = ("completions", "chat")
               ) -> dict[str, set[str]]:
    """endpoint -> the fields the table that starts with `header` lists for it ("both": the two of `both`)."""
    text = API_DOC.read_text()
    table = text[text.index(header):]
    table = table[:table.index("\n\n")]
    fields: dict[str, set[str]] = {endpoint: set() for endpoint in both}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        names = re.findall(r"`([a-z_]+)`", cells[0])
        for endpoint in both if cells[1] == "both" else (cells[1],):
            fields[endpoint].update(names)
    return fields


def schema_fields(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_table_lists_exactly_the_fields_each_endpoint_takes(endpoint):
    assert documented()[endpoint] == schema_fields(ENDPOINTS[endpoint][1])


@pytest.fixture(scope="module")
def server(engine_bundle, tmp_path_factory):
    bundle = tmp_path_factory.mktemp("fields") / "bundle"
    shutil.copytree(engine_bundle, bundle)
    (bundle / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    with ServerThread(settings(bundle, http_port=free_port())) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    with oai(server) as client:
        yield client


def post(api: openai.OpenAI, endpoint: str, extra: dict) -> dict:
    path, _, base = ENDPOINTS[endpoint]
    return api.post(path, body={**base, **extra}, cast_to=object)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_documented_field_is_accepted_with_a_valid_value(api, endpoint):
    for field in sorted(documented()[endpoint]):
        extra = ACCEPTED[field]
        extra = extra.get(endpoint, extra) if field == "logprobs" else extra
        answer = post(api, endpoint, extra)
        assert answer["choices"], (field, answer)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_documented_refusals_name_their_field(api, endpoint):
    for field, value in REFUSED.items():
        if field not in documented()[endpoint]:
            continue
        with pytest.raises(openai.BadRequestError) as e:
            post(api, endpoint, {field: value})
        assert e.value.body["param"] == field, (field, e.value.body)
    for field, value, param in REFUSED_ENTRIES:
        with pytest.raises(openai.BadRequestError) as e:
            post(api, endpoint, {field: value})
        assert e.value.body["param"] == param, (value, e.value.body)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", ["frobnicate", "functions", "guided_decoding_backend", "mm_processor_kwargs"])
def test_a_field_the_table_does_not_list_is_refused_by_name(api, endpoint, field):
    with pytest.raises(openai.BadRequestError) as e:
        post(api, endpoint, {field: 1})
    assert e.value.body["param"] == field and "not a field this server implements" in e.value.body["message"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field, value, expected", [
    ("top_p", "0.9", 'must be a number; got "0.9"'), ("temperature", "0.8", 'must be a number; got "0.8"'),
    ("max_tokens", 1.5, "must be an integer; got 1.5"), ("n", "2", 'must be an integer; got "2"'),
])
def test_a_value_of_the_wrong_type_is_a_400_naming_the_type_the_field_takes(api, endpoint, field, value, expected):
    """Every field is walked without a server in tests/fronts/test_field_types.py; these go over HTTP."""
    with pytest.raises(openai.BadRequestError) as e:
        post(api, endpoint, {field: value})
    assert e.value.body == {"message": f"{field}: {expected}", "type": "invalid_request_error", "param": field,
                            "code": None}


# ---- /tokenize and /detokenize ------------------------------------------------------------------------------

TOKENIZER_TABLE = ("| field | endpoint | type |", ("tokenize", "detokenize"))
TOKENIZER_SCHEMAS = {"tokenize": (TokenizePrompt, TokenizeChat), "detokenize": (Detokenize,)}
MESSAGES = [{"role": "user", "content": "x"}]
# a valid body holding each documented field
TOKENIZER_ACCEPTED = {
    "tokenize": {
        "model": {"prompt": "x", "model": ""}, "prompt": {"prompt": "To be"}, "messages": {"messages": MESSAGES},
        "add_special_tokens": {"prompt": "x", "add_special_tokens": False},
        "add_generation_prompt": {"messages": MESSAGES, "add_generation_prompt": False},
        "continue_final_message": {"messages": [*MESSAGES, {"role": "assistant", "content": "So"}],
                                   "add_generation_prompt": False, "continue_final_message": True},
        "tools": {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "chat_template_kwargs": {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        "return_token_strs": {"prompt": "x", "return_token_strs": True},
    },
    "detokenize": {"model": {"tokens": [5], "model": ""}, "tokens": {"tokens": [5, 6]}},
}


@pytest.mark.parametrize("endpoint", TOKENIZER_SCHEMAS)
def test_the_tokenizer_table_lists_exactly_the_fields_each_endpoint_takes(endpoint):
    taken = set().union(*(schema_fields(schema) for schema in TOKENIZER_SCHEMAS[endpoint]))
    assert documented(*TOKENIZER_TABLE)[endpoint] == taken


@pytest.mark.parametrize("endpoint", TOKENIZER_SCHEMAS)
def test_every_documented_tokenizer_field_is_accepted_with_a_valid_value(server, endpoint):
    for field in sorted(documented(*TOKENIZER_TABLE)[endpoint]):
        r = raw(server, "POST", f"/{endpoint}", TOKENIZER_ACCEPTED[endpoint][field])
        assert r.status_code == 200, (field, r.text)
        assert ("tokens" if endpoint == "tokenize" else "prompt") in r.json(), (field, r.json())


@pytest.mark.parametrize("body", [{"prompt": "x"}, {"messages": MESSAGES}, {"tokens": [5]}])
def test_a_field_the_tokenizer_table_does_not_list_is_refused_by_name(server, body):
    path = "/detokenize" if "tokens" in body else "/tokenize"
    r = raw(server, "POST", path, {**body, "frobnicate": 1})
    error = error_of(r)
    assert r.status_code == 400 and error["param"] == "frobnicate"
    assert "not a field this server implements" in error["message"]
