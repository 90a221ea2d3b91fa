"""Structured output through both fronts: JSON schemas, any JSON object, regexes, choices and grammars;
the openai SDK's `parse`; clear 400s (INVALID_ARGUMENT) for constraints that do not compile; no field
silently ignored; and a fuzz of constraint fields that never gives a 5xx nor changes a stream beside it."""

from __future__ import annotations

import json
import random
import re
import string
import threading
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from attnserve.v1 import generate_pb2 as pb
from service.client import Client
from tests.fronts.server_harness import (
    ServerThread,
    free_port,
    settings,
    templated_server,
    with_chat_template,
)
from tests.fronts.test_http_api import CHATML, oai

PROMPT = [5, 6, 7]


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    _object({"a": {"type": "integer", "minimum": 0, "maximum": 9}}),
    _object({"c": {"enum": ["red", "green", "blue"]}}),
    _object({"p": _object({"x": {"type": "integer", "minimum": -5, "maximum": 5},
                           "y": {"type": "integer", "minimum": -5, "maximum": 5}})}),
    _object({"v": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                   "minItems": 1, "maxItems": 3}}),
    _object({"s": {"type": "string", "minLength": 1, "maxLength": 5}}),
    _object({"ok": {"type": "boolean"}, "n": {"type": "null"}}),
    _object({"t": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    {"type": "array", "items": _object({"k": {"enum": ["a", "b"]}}), "maxItems": 2},
    _object({"a": {"type": "integer", "minimum": 1, "maximum": 3}, "b": {"type": "string", "maxLength": 2}},
            required=["a"]),
    _object({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
]


@pytest.fixture(scope="module")
def chat_server(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("structured"), CHATML) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(chat_server):
    with oai(chat_server) as c:
        yield c


@pytest.fixture(scope="module")
def client(chat_server):
    with Client(chat_server.address, timeout_s=60) as c:
        yield c


def assert_ten_valid_generations(api, client, front: str, index: int) -> None:
    """10 sampled generations under SCHEMAS[index] over one front, every one complete and valid."""
    schema = SCHEMAS[index]
    texts = []
    for seed in (index, 100 + index):  # 2 x 5 completions: the test servers run 8 sequences at most
        if front == "http":
            out = api.completions.create(model="", prompt=PROMPT, n=5, max_tokens=100, temperature=1.0, seed=seed,
                                         extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                             "name": f"s{index}", "schema": schema, "strict": True}}})
            texts += [(c.text, c.finish_reason == "stop") for c in out.choices]
        else:
            out = client.generate(PROMPT, n=5, max_new_tokens=100, temperature=1.0, seed=seed,
                                  json_schema=json.dumps(schema))
            texts += [(c.text, c.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE) for c in out.completions]
    assert len(texts) == 10
    for text, complete in texts:
        assert complete, text
        jsonschema.validate(json.loads(text), schema)


def assert_parse_gives_objects(api) -> None:
    for seed in range(5):
        out = api.chat.completions.parse(model="", messages=[{"role": "user", "content": "a pet"}],
                                         response_format=Pet, max_tokens=60, seed=seed)
        message = out.choices[0].message
        assert isinstance(message.parsed, Pet) and message.refusal is None
        assert Pet.model_validate_json(message.content) == message.parsed


class Pet(BaseModel):
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=20)
    tags: list[Literal["calm", "loud"]] = Field(max_length=2)


@pytest.mark.parametrize("front", ["http", "grpc"])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_generation_validates_against_its_schema(api, client, front, index):
    assert_ten_valid_generations(api, client, front, index)


def test_a_llama_family_bundle_validates_every_schema_and_parses(llama_bundle, tmp_path_factory):
    bundle = with_chat_template(llama_bundle, tmp_path_factory.mktemp("llama-json"), CHATML)
    with ServerThread(settings(bundle, http_port=free_port())) as srv, oai(srv) as api, \
            Client(srv.address, timeout_s=60) as client:
        for front in ("http", "grpc"):
            for index in range(len(SCHEMAS)):
                assert_ten_valid_generations(api, client, front, index)
        assert_parse_gives_objects(api)


def test_json_object_regex_choice_and_grammar_on_both_fronts(api, client):
    asks = [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_regex": r"[a-c]{3}-[0-9]"}, {"regex": r"[a-c]{3}-[0-9]"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]", t)),
        ({"guided_choice": ["yes", "no"]}, {"choice": pb.Choices(choices=["yes", "no"])}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'start: "n=" /[0-9]{2}/'}}, {"grammar": 'start: "n=" /[0-9]{2}/'},
         lambda t: re.fullmatch(r"n=[0-9]{2}", t)),
        ({"guided_grammar": 'root ::= "x" [0-9]'}, {"grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch("x[0-9]", t)),
        ({"structured_outputs": {"json": SCHEMAS[1]}}, {"json_schema": json.dumps(SCHEMAS[1])},
         lambda t: json.loads(t)["c"] in ("red", "green", "blue")),
    ]
    for body, fields, check in asks:
        http = api.completions.create(model="", prompt=PROMPT, n=3, max_tokens=60, seed=1, extra_body=body)
        rpc = client.generate(PROMPT, n=3, max_new_tokens=60, seed=1, **fields)
        outputs = [(c.text, c.finish_reason == "stop") for c in http.choices]
        outputs += [(c.text, c.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE) for c in rpc.completions]
        for text, complete in outputs:
            # any JSON object is unbounded: a model may still be inside a string at max_tokens (documented)
            assert complete or "json_object" in str(body), (body, text)
            assert check(text) if complete else len(text) > 0, (body, text)


def test_the_sdk_parse_returns_a_parsed_object(api):
    assert_parse_gives_objects(api)


def test_chat_json_mode_and_streaming_give_the_same_json(api):
    ask = {"model": "", "messages": [{"role": "user", "content": "json"}], "max_tokens": 60, "seed": 3,
           "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[2]}}}
    whole = api.chat.completions.create(**ask).choices[0]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in api.chat.completions.create(**ask, stream=True)
                       if chunk.choices)
    assert whole.finish_reason == "stop" and streamed == whole.message.content
    jsonschema.validate(json.loads(streamed), SCHEMAS[2])
    assert not {"reasoning_content", "reasoning"} & set(whole.message.model_dump())  # a template without sections


def test_too_few_tokens_end_with_length(api):
    out = api.completions.create(model="", prompt=PROMPT, max_tokens=3, extra_body={"guided_json": SCHEMAS[2]})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/missing"}}}}}}, "response_format.json_schema.schema", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "must be one of 'text', 'json_object', 'json_schema'; got \"xml\""),
    ({"guided_regex": "a(b"}, "guided_regex", "regex does not compile"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "grammar does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "cannot be used"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one constraint"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not a field this server implements"),
    ({"frobnicate": 1}, "frobnicate", "not a field this server implements"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not a field this server implements"),
])
def test_bad_constraints_and_unknown_fields_get_a_400_naming_the_field(api, body, param, message):
    for create, ask in ((api.completions.create, {"prompt": PROMPT}),
                        (api.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model="", max_tokens=5, **ask, extra_body=body)
        error = e.value.body
        assert error["param"] == param and message in error["message"], error


def test_accepted_openai_fields_that_change_nothing(api):
    out = api.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1,
                                      user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
                                      response_format={"type": "text"}, extra_body={"safety_identifier": "s",
                                                                                    "prompt_cache_key": "k"})
    plain = api.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1)
    assert out.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("fields, message", [
    ({"regex": "a(b"}, "regex does not compile"),
    ({"json_schema": "[1, 2"}, "cannot be used"),
    ({"grammar": "start: nowhere"}, "grammar does not compile"),
    ({"choice": pb.Choices()}, "non-empty list"),
    ({"json_object": False}, "set it to true"),
])
def test_grpc_refuses_bad_constraints_with_invalid_argument(client, fields, message):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(PROMPT, max_new_tokens=4, **fields)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


def _fuzz_body(rng: random.Random) -> dict:
    junk = "".join(rng.choice(string.printable + "{}[]()|*+?\\^$") for _ in range(rng.randint(0, 30)))
    kind = rng.randrange(7)
    if kind == 0:
        return {"guided_regex": junk}
    if kind == 1:
        return {"guided_grammar": junk}
    if kind == 2:
        return {"guided_choice": [junk, junk[::-1]]}
    if kind == 3:
        return {"guided_json": junk}
    if kind == 4:
        keys = rng.sample(["type", "properties", "items", "enum", "minimum", "pattern", "$ref", "anyOf"], 3)
        return {"guided_json": {k: rng.choice([junk, 3, [], {}, None, True, {"type": junk}]) for k in keys}}
    if kind == 5:
        return {"response_format": {"type": rng.choice(["json_schema", "json_object", junk]),
                                    "json_schema": {"name": junk, "schema": {"type": rng.choice(["object", junk])}}}}
    return {"structured_outputs": {rng.choice(["json", "regex", "choice", "grammar", junk]): junk}}


def test_a_fuzz_of_constraint_fields_gives_no_5xx_and_leaves_a_stream_beside_it_unchanged(api):
    ask = {"model": "", "prompt": [9, 8, 7], "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = "".join(c.choices[0].text for c in api.completions.create(**ask, stream=True) if c.choices)
    beside: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with oai_of(api) as other:
            parts = []
            for chunk in other.completions.create(**ask, stream=True):
                started.set()
                parts += [chunk.choices[0].text] if chunk.choices else []
            beside.append("".join(parts))

    thread = threading.Thread(target=stream)
    thread.start()
    started.wait(30)
    rng = random.Random(0)
    statuses = []
    for _ in range(60):
        try:
            api.completions.create(model="", prompt=PROMPT, max_tokens=8, extra_body=_fuzz_body(rng))
            statuses.append(200)
        except openai.BadRequestError:
            statuses.append(400)
    thread.join(60)
    assert set(statuses) <= {200, 400} and 400 in statuses
    assert beside == [alone]


def oai_of(api: openai.OpenAI) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(api.base_url), api_key="unused", max_retries=0, timeout=60)
