"""A value of the wrong JSON type in an HTTP body is refused naming the field as the client spelled it, the
value, and the type the schema takes there. Every field of every body model is walked, nested models
included, with the expected words read from pydantic's JSON schema of the bodies (an oracle apart from
the annotations the server reads); the body is validated as the endpoints validate it, without a server
(tests/fronts/test_request_fields.py sends the same over HTTP)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from service.engine.errors import InvalidRequest
from service.fronts.http.openai_schema import ChatCompletionRequest, CompletionRequest
from service.fronts.http.request_body import validated
from service.fronts.http.tokenize import Detokenize, TokenizeChat, TokenizePrompt

# a valid body of each endpoint that holds every nested model, so that each of their fields is reached
NESTED = {"stream_options": {"include_usage": True}, "structured_outputs": {"regex": "a"},
          "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}
BODIES = {
    "completions": (CompletionRequest, {"prompt": "hi", **NESTED}),
    "chat": (ChatCompletionRequest, {**NESTED, "messages": [
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}], "tool_call_id": "c",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}),
}
CHAT_PROMPT = {"messages": BODIES["chat"][1]["messages"], "tools": BODIES["chat"][1]["tools"],
               "chat_template_kwargs": {}}
BODIES |= {"tokenize_prompt": (TokenizePrompt, {"prompt": "hi"}), "tokenize_chat": (TokenizeChat, CHAT_PROMPT),
           "detokenize": (Detokenize, {"tokens": [1, 2]})}
# a value of each JSON type, and the words for the type
SAMPLES = {"string": "0.9", "integer": 2, "number": 1.5, "boolean": True, "object": {"k": 1}, "array": [{"k": 1}]}
WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
         "object": "an object", "array": "an array"}


def alternatives(prop: dict, defs: dict) -> list[dict]:
    """The JSON schemas a property may match, references resolved, null left out (it means unset)."""
    out = []
    for alt in prop.get("anyOf", [prop]):
        alt = defs[alt["$ref"].split("/")[-1]] if "$ref" in alt else alt
        if alt.get("type") != "null":
            out.append(alt)
    return out


def takes(alt: dict, value: Any) -> bool:
    if "enum" in alt or "const" in alt:
        return value in alt.get("enum", [alt.get("const")])
    kind = alt.get("type")
    json_type = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object",
                 list: "array"}[type(value)]
    return kind is None or kind == json_type or (kind == "number" and json_type == "integer")


def expected_words(alts: list[dict]) -> tuple[set[str], list[str]]:
    """The type words a message should hold (a number takes integers, so not both) and the literal values."""
    kinds = {alt["type"] for alt in alts if "type" in alt and "enum" not in alt and "const" not in alt}
    if "number" in kinds:
        kinds.discard("integer")
    literals = [v for alt in alts for v in alt.get("enum", [alt["const"]] if "const" in alt else [])]
    return {WORDS[kind] for kind in kinds}, literals


def wrong_type_cases(defs: dict, model: dict, body: Any, loc: tuple) -> Iterator[tuple[tuple, Any, list[dict]]]:
    """(where, a value of a type the field does not take, its alternatives) for every field of `model`
    (whose value in the body is at `loc`), and inside the nested models the body holds."""
    here = body
    for part in loc:
        here = here[part]
    for name, prop in model["properties"].items():
        alts = alternatives(prop, defs)
        for value in SAMPLES.values():
            if alts and not any(takes(alt, value) for alt in alts):
                yield loc + (name,), value, alts
        inner = here.get(name)
        for alt in alts:
            if "properties" in alt and isinstance(inner, dict):
                yield from wrong_type_cases(defs, alt, body, loc + (name,))
            items = alt.get("items", {})
            if alt.get("type") == "array" and "$ref" in items and inner:
                yield from wrong_type_cases(defs, defs[items["$ref"].split("/")[-1]], body, loc + (name, 0))


def spelled(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(loc))


def cases() -> Iterator[Any]:
    for endpoint, (schema, body) in BODIES.items():
        json_schema = schema.model_json_schema()
        for loc, value, alts in wrong_type_cases(json_schema.get("$defs", {}), json_schema, body, ()):
            yield pytest.param(schema, body, loc, value, alts, id=f"{endpoint}:{spelled(loc)}={json.dumps(value)}")


def refusal(schema, body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        validated(schema, body)
    return e.value


@pytest.mark.parametrize("endpoint", BODIES)
def test_the_bodies_are_valid_and_reach_every_nested_model(endpoint):
    schema, body = BODIES[endpoint]
    validated(schema, body)
    json_schema = schema.model_json_schema()
    defs = json_schema.get("$defs", {})
    reached = {spelled(loc[:-1]) for loc, _, _ in wrong_type_cases(defs, json_schema, body, ())}
    chat_prompt = {"messages[0]", "messages[0].content[0]", "messages[0].tool_calls[0]",
                   "messages[0].tool_calls[0].function", "tools[0]", "tools[0].function"}
    nested = {"completions": set(), "chat": chat_prompt | {"tool_choice", "tool_choice.function"},
              "tokenize_prompt": set(), "tokenize_chat": chat_prompt, "detokenize": set()}[endpoint]
    if endpoint in ("completions", "chat"):
        nested |= {"stream_options", "structured_outputs", "response_format", "response_format.json_schema"}
    assert reached == {""} | nested
    assert len(nested) == len(defs)  # a model at each: every model of the body is reached


@pytest.mark.parametrize("schema, body, loc, value, alts", list(cases()))
def test_a_value_of_a_wrong_type_is_named_with_the_type_the_field_takes(schema, body, loc, value, alts):
    body = copy.deepcopy(body)
    container = body
    for part in loc[:-1]:
        container = container[part]
    container[loc[-1]] = value
    error = refusal(schema, body)
    message = str(error).removeprefix(f"{error.field}: ")
    assert error.field == spelled(loc), str(error)
    assert message.startswith("must be ") and message.endswith(f"; got {json.dumps(value)}"), str(error)
    said = message.removeprefix("must be ").rsplit("; got ", 1)[0]
    words, literals = expected_words(alts)
    assert {w for w in WORDS.values() if w in said} == words, str(error)
    assert all(f"'{v}'" in said for v in literals), str(error)


@pytest.mark.parametrize("schema, base", [(CompletionRequest, {"prompt": "hi"}),
                                          (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("field, value, expected", [
    ("top_p", "0.9", 'top_p: must be a number; got "0.9"'),
    ("temperature", "0.8", 'temperature: must be a number; got "0.8"'),
    ("top_p", True, "top_p: must be a number; got true"),
    ("max_tokens", 1.5, "max_tokens: must be an integer; got 1.5"),
    ("n", "2", 'n: must be an integer; got "2"'),
    ("stop", 3, "stop: must be a string or an array of strings; got 3"),
    ("early_stopping", "x", "early_stopping: must be a boolean or 'never'; got \"x\""),
])
def test_the_reported_cases(schema, base, field, value, expected):
    assert str(refusal(schema, {**base, field: value})) == expected


@pytest.mark.parametrize("schema, body, expected", [
    (CompletionRequest, {"prompt": [1.5]}, "prompt: must be a string, an array of strings, an array of integers "
                                           "or an array of arrays of integers; got [1.5]"),
    (CompletionRequest, {"prompt": "hi", "stop": ["a", 3]}, "stop[1]: must be a string; got 3"),
    (CompletionRequest, {"prompt": "hi", "stop_token_ids": [1] * 100000 + ["x"]},
     'stop_token_ids[100000]: must be an integer; got "x"'),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "x"},
     "tool_choice: must be 'none', 'auto', 'required' or an object; got \"x\""),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                             "tool_choice": {"type": "function", "function": {"name": 3}}},
     "tool_choice.function.name: must be a string; got 3"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": 1}},
     "metadata.k: must be a string; got 1"),
    (CompletionRequest, [], "body: must be an object; got []"),
])
def test_a_wrong_type_inside_a_union_or_an_array_is_named_where_it_is(schema, body, expected):
    assert str(refusal(schema, body)) == expected


@pytest.mark.parametrize("schema, body, expected", [
    (CompletionRequest, {}, "prompt: is required"),
    (ChatCompletionRequest, {"messages": []}, "messages: List should have at least 1 item"),
    (CompletionRequest, {"prompt": "hi", "frobnicate": 1}, "frobnicate: is not a field this server implements"),
])
def test_what_is_not_a_wrong_type_keeps_its_own_message(schema, body, expected):
    assert str(refusal(schema, body)).startswith(expected)
