"""Request bodies of the HTTP front, fuzzed against a live server (hypothesis).

Whatever JSON arrives in whatever field, the answer is a 200 or a 4xx with OpenAI's error object, never
a 5xx; the server stays healthy, and a well-formed stream running beside the fuzz comes out exactly as
when run alone.
"""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is a development tool the serving lane does not install")
httpx2 = pytest.importorskip("httpx2")

from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64), st.floats(allow_nan=False),
                    st.sampled_from([0, 1, 2, 5, 16, -1, 0.5, 1.0, 1e9, "", "x", "<|endoftext|>"]),
                    st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
small_ints = st.integers(-3, 40)
COMMON = {
    "model": st.one_of(st.none(), st.just(""), st.text(max_size=12)),
    "max_tokens": st.one_of(small_ints, json_values),
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), json_values),
    "n": st.one_of(st.integers(-1, 20), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=300), max_size=20), json_values),
    "seed": st.one_of(st.integers(-5, 2**65), json_values),
    "presence_penalty": st.one_of(st.floats(-3, 3), json_values),
    "frequency_penalty": st.one_of(st.floats(-3, 3), json_values),
    "top_k": st.one_of(st.integers(-2, 10**6), json_values),
    "min_p": st.one_of(st.floats(-1, 2), json_values),
    "repetition_penalty": st.one_of(st.floats(-1, 12), json_values),
    "min_tokens": st.one_of(small_ints, json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 10**6), max_size=5), json_values),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 10**6).map(str)),
                                            st.one_of(st.floats(-150, 150), st.integers(-10**20, 10**20)),
                                            max_size=6), json_values),
    "priority": st.one_of(st.integers(-2**40, 2**40), json_values),
    "timeout": st.one_of(st.floats(-1, 30), json_values),
    "user": json_values,
    "unknown_field": json_values,
}
COMPLETION = {
    "prompt": st.one_of(st.text(max_size=200), st.lists(st.text(max_size=20), max_size=4),
                        st.lists(st.integers(-5, 10**6), max_size=50), json_values),
    "echo": st.one_of(st.booleans(), json_values),
    "logprobs": st.one_of(st.integers(-2, 30), json_values),
    "suffix": json_values,
    "best_of": json_values,
}
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                           "content": st.one_of(st.text(max_size=100), json_values)}), json_values)
CHAT = {
    "messages": st.one_of(st.lists(message, max_size=4), json_values),
    "max_completion_tokens": st.one_of(small_ints, json_values),
    "logprobs": st.one_of(st.booleans(), json_values),
    "top_logprobs": st.one_of(st.integers(-2, 30), json_values),
    "tools": st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": st.one_of(
        st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["f", "g"]), st.text(max_size=8))},
                              optional={"parameters": json_values, "description": json_values}), json_values)}),
        max_size=3), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
                             json_values),
    "parallel_tool_calls": st.one_of(st.booleans(), json_values),
    "response_format": json_values,
}


@st.composite
def bodies(draw):
    path, specific = draw(st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]))
    fields = {**COMMON, **specific}
    chosen = draw(st.sets(st.sampled_from(sorted(fields)), max_size=8))
    body = {name: draw(fields[name]) for name in sorted(chosen)}
    if draw(st.integers(0, 9)) == 0:
        body = draw(json_values)  # not even an object
    return path, body


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.http_url, timeout=120) as h:
        yield h


def stream_text(h: httpx2.Client) -> str:
    body = {"prompt": "Rom.\nBut soft", "max_tokens": 24, "temperature": 0.8, "seed": 17, "stream": True}
    with h.stream("POST", "/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


FUZZ = hsettings(max_examples=250, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_no_body_gets_a_5xx_and_streams_beside_are_unchanged(server, http):
    expected = stream_text(http)
    stop, seen, problems = threading.Event(), [], []

    def beside():
        with httpx2.Client(base_url=server.http_url, timeout=120) as h:
            while not stop.is_set():
                got = stream_text(h)
                seen.append(got)
                if got != expected:
                    problems.append(got)

    thread = threading.Thread(target=beside, daemon=True)
    thread.start()

    @FUZZ
    @given(bodies())
    def one(case):
        path, body = case
        r = http.post(path, content=json.dumps(body))
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)

    try:
        one()
    finally:
        stop.set()
        thread.join(120)
    assert problems == [] and len(seen) >= 1
    assert http.get("/health").status_code == 200


TOOL_TEMPLATE = "{# <tool_call> #}{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
called = st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "arguments": st.one_of(
    st.just('{"a": 1}'), st.text(max_size=10), json_values)})}, optional={"id": json_values, "type": json_values})
tool_turn = st.fixed_dictionaries({"role": st.sampled_from(["assistant", "tool"])}, optional={
    "content": st.one_of(st.text(max_size=20), json_values), "tool_calls": st.one_of(st.lists(called, max_size=2), json_values),
    "tool_call_id": json_values})
conversations = st.one_of(st.just([{"role": "user", "content": "hi"}]),
                          st.lists(st.one_of(tool_turn, st.just({"role": "user", "content": "hi"})), min_size=1, max_size=3))


def test_no_tools_body_gets_a_5xx(engine_bundle, tmp_path_factory):
    """Tools reach a template that renders them, and a grammar is built for them: still never a 5xx."""
    from tests.fronts.server_harness import templated_server

    with templated_server(engine_bundle, tmp_path_factory.mktemp("tools"), TOOL_TEMPLATE) as srv, \
            httpx2.Client(base_url=srv.http_url, timeout=120) as h:

        @hsettings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
        @given(st.fixed_dictionaries({"messages": conversations, "max_tokens": st.just(2)},
                                     optional={name: CHAT[name] for name in TOOL_FIELDS}))
        def one(body):
            r = h.post("/v1/chat/completions", content=json.dumps(body))
            assert r.status_code < 500, (body, r.text)

        one()
        assert h.get("/health").status_code == 200


# ---- constraint fields: what a compile error or a fault may show ----------------------------------------

regex_text = st.text(alphabet="ab01.*+?()[]{}|^$\\-:,<>dswS", max_size=16)
grammar_text = st.one_of(st.text(max_size=40), st.builds(
    lambda rule, body: f"start: {rule}\n{rule}: {body}\n", st.sampled_from(["x", "start", "%json", "a_1"]),
    st.text(alphabet='ab"/|()*+?%{}:<>[] \n\\', max_size=24)), st.sampled_from(
    ['root ::= "a" | "b"', 'root ::= [a-z]+', "start: %json {\"type\": 5}", 'start: <|endoftext|> "x"',
     "start: <[99999]>", 'start: "<tool_call>" /[0-9]+/']))
schema = st.recursive(st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null", "x"]),
                      json_values),
    "pattern": regex_text, "format": st.sampled_from(["date", "email", "uuid", "no-such-format"]),
    "minLength": st.integers(-1, 5), "maxLength": st.integers(-1, 5), "enum": st.lists(scalars, max_size=3),
    "$ref": st.sampled_from(["#/$defs/x", "#", "http://x"])}),
    lambda inner: st.fixed_dictionaries({}, optional={"properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
                                                      "items": inner, "anyOf": st.lists(inner, max_size=3),
                                                      "required": st.lists(st.text(max_size=4), max_size=2)}),
    max_leaves=6)
CONSTRAINTS = {
    "guided_regex": st.one_of(regex_text, json_values),
    "guided_grammar": st.one_of(grammar_text, json_values),
    "guided_choice": st.one_of(st.lists(st.text(max_size=6), max_size=4), json_values),
    "guided_json": st.one_of(schema, st.text(max_size=20), json_values),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": st.just("x"), "schema": st.one_of(schema, json_values)})}), st.just({"type": "json_object"}), json_values),
    "structured_outputs": st.one_of(st.fixed_dictionaries({}, optional={
        "regex": regex_text, "grammar": grammar_text, "json": schema, "choice": st.lists(st.text(max_size=6), max_size=3)}),
        json_values),
}
INTERNALS = ("<state>", "</state>", "<grammar>", "Traceback", "LexerSpec", "Parser:", "stats:", "File \"")


def test_no_constraint_error_shows_internals(server, http):
    """A constraint that does not compile is a 400 that says why in a few words; whatever the constraint, no
    answer (a 4xx, or a stream's error event) carries a parser's state, a grammar dump or a traceback."""

    @FUZZ
    @given(st.sampled_from(sorted(CONSTRAINTS)).flatmap(lambda name: st.tuples(st.just(name), CONSTRAINTS[name])),
           st.booleans())
    def one(constraint, stream):
        name, value = constraint
        body = {"prompt": "Rom.", "max_tokens": 4, "stream": stream, name: value}
        r = http.post("/v1/completions", content=json.dumps(body))
        assert r.status_code < 500, (body, r.text)
        errors = [r.json()["error"]] if r.status_code >= 400 else [
            json.loads(line[6:])["error"] for line in r.text.splitlines()
            if line.startswith("data: {") and '"error"' in line[:20]]
        for error in errors:
            assert not any(marker in error["message"] for marker in INTERNALS), (body, error)
            assert len(error["message"]) <= 600, (body, error)

    one()
    assert http.get("/health").status_code == 200
