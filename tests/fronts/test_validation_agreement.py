"""One rule, two fronts: a request that breaks a rule is refused by the same rule over gRPC and over HTTP
(both endpoints), each naming the field as its own protocol spells it, never a field only the other has.

Each row is one broken rule, written in both protocols' terms: the gRPC fields (`build_request`'s flat
keywords, on a prompt of token ids and max_new_tokens 4) and the HTTP body fields (on a prompt of token
ids, or one user message, and max_tokens 4), the field each front must name, and what both messages say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import grpc
import openai
import pytest

from attnserve.v1 import generate_pb2 as pb
from service.client import Client, build_request
from service.fronts.http.openai_schema import ChatCompletionRequest, CompletionRequest
from tests.fronts.server_harness import ServerThread, templated_server
from tests.fronts.test_http_api import CHATML, oai

PROMPT = [5, 6, 7, 8]
BEAM = {"use_beam_search": True, "best_of": 2}
LONG_TEXT = "Rom. " * 40_000  # more characters than any test model's context could take, whatever its tokens
TOO_MANY_IDS = [5] * 20_000  # more tokens than any test model's context
BASES = {"completions": ("/completions", {"prompt": PROMPT, "max_tokens": 4}),
         "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})}


@dataclass
class Rule:
    grpc: dict  # build_request's keywords; "prompt" replaces PROMPT
    http: dict  # body fields on both endpoints, or {"completions": {...}, "chat": {...}} (an endpoint left out: n/a)
    grpc_field: str
    http_param: str | dict[str, str]  # per endpoint where they differ
    says: str  # in both fronts' messages
    endpoints: tuple[str, ...] = field(default=("completions", "chat"))

    def body(self, endpoint: str) -> dict | None:
        per_endpoint = set(self.http) <= set(BASES)
        return self.http.get(endpoint) if per_endpoint else self.http

    def param(self, endpoint: str) -> str:
        return self.http_param if isinstance(self.http_param, str) else self.http_param[endpoint]


RULES = {
    "beam search with a temperature": Rule(
        dict(beam_width=2, temperature=0.7), {**BEAM, "temperature": 0.7}, "sampling.temperature", "temperature",
        "does not apply to beam search"),
    "one beam": Rule(dict(beam_width=1), {**BEAM, "best_of": 1}, "beam_width", "best_of", "1 is outside [2, 16]"),
    "more beams than any request may have": Rule(
        dict(beam_width=17), {**BEAM, "best_of": 17}, "beam_width", "best_of", "17 is outside [2, 16]"),
    "more beams than the engine runs": Rule(
        dict(beam_width=9), {**BEAM, "best_of": 9}, "beam_width", "best_of", "this engine runs at most 8"),
    "a length penalty without beam search": Rule(
        dict(length_penalty=2.0), {"length_penalty": 2.0}, "length_penalty", "length_penalty", "beam search only"),
    "early stopping without beam search": Rule(
        dict(beam_stopping=pb.BEAM_STOPPING_EARLY), {"early_stopping": True}, "beam_stopping", "early_stopping",
        "beam search only"),
    "a length penalty out of range": Rule(
        dict(beam_width=2, length_penalty=11.0), {**BEAM, "length_penalty": 11}, "length_penalty", "length_penalty",
        "is outside [-10, 10]"),
    "beam search with top_k": Rule(
        dict(beam_width=2, top_k=5), {**BEAM, "top_k": 5}, "sampling.top_k", "top_k", "does not apply to beam search"),
    "beam search with a minimum length": Rule(
        dict(beam_width=2, min_new_tokens=1), {**BEAM, "min_tokens": 1}, "stopping.min_new_tokens", "min_tokens",
        "does not apply to beam search"),
    "beam search with a constraint": Rule(
        dict(beam_width=2, regex="[a-z]+"), {**BEAM, "guided_regex": "[a-z]+"}, "constraint", "guided_regex",
        "does not apply to beam search"),
    "beam search with logprobs": Rule(
        dict(beam_width=2, logprobs=True), {"completions": {**BEAM, "logprobs": 1}, "chat": {**BEAM, "logprobs": True}},
        "logprobs", "logprobs", "does not apply to beam search"),
    "more completions than beams": Rule(
        dict(beam_width=2, n=3), {**BEAM, "n": 3}, "n", "n", "3 is outside [1, 2]"),
    "a negative temperature": Rule(
        dict(temperature=-1.0), {"temperature": -1}, "sampling.temperature", "temperature", "is outside [0.0, 100.0]"),
    "more new tokens than the context": Rule(
        dict(max_new_tokens=10_000), {"max_tokens": 10_000}, "stopping.max_new_tokens", "max_tokens",
        "exceed the context of"),
    "a minimum past the maximum": Rule(
        dict(min_new_tokens=5), {"min_tokens": 5}, "stopping.min_new_tokens", "min_tokens", "5 is outside [0, 4]"),
    "a stop id outside the vocabulary": Rule(
        dict(stop_token_ids=[10**9]), {"stop_token_ids": [10**9]}, "stopping.stop_token_ids[0]", "stop_token_ids",
        "1000000000 is outside [0, "),
    "too many completions": Rule(dict(n=17), {"n": 17}, "n", "n", "17 is outside [1, 16]"),
    "too many alternatives": Rule(
        dict(top_logprobs=21), {"completions": {"logprobs": 21}, "chat": {"logprobs": True, "top_logprobs": 21}},
        "top_logprobs", {"completions": "logprobs", "chat": "top_logprobs"}, "21 is outside [0, 20]"),
    "a logit bias out of range": Rule(
        dict(logit_bias={5: 101.0}), {"logit_bias": {"5": 101}}, "sampling.logit_bias.5", "logit_bias.5",
        "is outside [-100, 100]"),
    "a logit bias on an id outside the vocabulary": Rule(
        dict(logit_bias={10**6: 1.0}), {"logit_bias": {"1000000": 1}}, "sampling.logit_bias.1000000",
        "logit_bias.1000000", "1000000 is outside the vocabulary"),
    "too many logit biases": Rule(
        dict(logit_bias=dict.fromkeys(range(301), 1.0)), {"logit_bias": dict.fromkeys(map(str, range(301)), 1)},
        "sampling.logit_bias", "logit_bias", "has 301 entries; the most allowed is 300"),
    "beam search with a logit bias": Rule(
        dict(beam_width=2, logit_bias={5: 1.0}), {**BEAM, "logit_bias": {"5": 1}}, "sampling.logit_bias", "logit_bias",
        "does not apply to beam search"),
    "a prompt id outside the vocabulary": Rule(
        dict(prompt=[5, 10**9]), {"completions": {"prompt": [5, 10**9]}}, "prompt_token_ids[1]", "prompt",
        "1000000000 is outside the vocabulary"),
    "a prompt of more tokens than the context": Rule(
        dict(prompt=TOO_MANY_IDS), {"completions": {"prompt": TOO_MANY_IDS}}, "prompt", "prompt",
        "20000 tokens cannot fit"),
    "a prompt text longer than any prompt": Rule(
        dict(prompt=LONG_TEXT), {"completions": {"prompt": LONG_TEXT},
                                 "chat": {"messages": [{"role": "user", "content": LONG_TEXT}]}},
        "prompt", {"completions": "prompt", "chat": "messages"}, "characters; the limit is"),
}


def proto_names(descriptor) -> set[str]:
    names = set()
    for f in descriptor.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= proto_names(f.message_type)
    return names


def schema_names() -> set[str]:
    return {info.alias or name for schema in (CompletionRequest, ChatCompletionRequest)
            for name, info in schema.model_fields.items()}


# the field names one protocol has and the other has not (identifiers only: "model" or "stream" are also words)
GRPC_NAMES, HTTP_NAMES = proto_names(pb.GenerateRequest.DESCRIPTOR), schema_names()
GRPC_ONLY = {n for n in GRPC_NAMES - HTTP_NAMES if "_" in n}
HTTP_ONLY = {n for n in HTTP_NAMES - GRPC_NAMES if "_" in n}


def mentioned(message: str, names: set[str]) -> set[str]:
    return {n for n in names if re.search(rf"(?<![\w.]){n}(?!\w)", message)}


@pytest.fixture(scope="module")
def srv(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("agreement"), CHATML) as s:
        yield s


def grpc_refusal(srv: ServerThread, fields: dict) -> str:
    fields = {"max_new_tokens": 4, **fields}
    with Client(srv.address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(build_request(fields.pop("prompt", PROMPT), **fields), timeout=60)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def http_refusal(srv: ServerThread, endpoint: str, fields: dict) -> dict:
    path, base = BASES[endpoint]
    with oai(srv) as api, pytest.raises(openai.BadRequestError) as e:
        api.post(path, body={**base, **fields}, cast_to=object)
    return e.value.body


@pytest.mark.parametrize("name", RULES)
def test_a_broken_rule_is_refused_on_both_fronts_naming_each_fronts_own_field(srv, name):
    rule = RULES[name]
    details = grpc_refusal(srv, rule.grpc)
    assert details.startswith(rule.grpc_field + ": ") and rule.says in details, details
    assert not mentioned(details, HTTP_ONLY), details
    for endpoint in BASES:
        body = rule.body(endpoint)
        if body is None:
            continue
        error = http_refusal(srv, endpoint, body)
        param = rule.param(endpoint)
        assert error["param"] == param and error["message"].startswith(param + ": "), (endpoint, error)
        assert rule.says in error["message"], (endpoint, error)
        assert not mentioned(error["message"], GRPC_ONLY), (endpoint, error)


def test_text_too_long_is_one_rule_for_every_field_that_takes_text(srv):
    """Tokenize's text, a prompt on either front and a chat's rendered messages: one limit, one message."""
    with Client(srv.address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as e:
        client.stub.Tokenize(pb.TokenizeRequest(text=LONG_TEXT), timeout=60)
    messages = {"text": e.value.details(), "prompt": grpc_refusal(srv, {"prompt": LONG_TEXT}),
                "completions": http_refusal(srv, "completions", {"prompt": LONG_TEXT})["message"],
                "chat": http_refusal(srv, "chat", {"messages": [{"role": "user", "content": LONG_TEXT}]})["message"]}
    limits = {name: re.search(r"characters; (the limit is \d+ .*)$", m) for name, m in messages.items()}
    assert all(limits.values()), messages
    assert len({m.group(1) for m in limits.values()}) == 1, messages


def test_beam_search_takes_a_seed_and_temperature_0_on_both_fronts(srv):
    """Beam search does not sample: a seed, which it does not use, is accepted as greedy sampling accepts it, and
    so is the temperature it runs at, 0; both fronts return the same hypotheses."""
    with Client(srv.address, timeout_s=60) as client:
        alone = client.generate(PROMPT, beam_width=2, max_new_tokens=4)
        given = client.generate(PROMPT, beam_width=2, max_new_tokens=4, seed=7, temperature=0.0)
    assert [list(c.token_ids) for c in given.completions] == [list(c.token_ids) for c in alone.completions]
    with oai(srv) as api:
        answer = api.post("/completions", body={**BASES["completions"][1], **BEAM, "seed": 7, "temperature": 0},
                          cast_to=object)
    assert [c["text"] for c in answer["choices"]] == [c.text for c in alone.completions]
