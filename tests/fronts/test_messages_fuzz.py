"""Messages API bodies, fuzzed against a live server whose template renders tools and opens a reasoning section
(hypothesis): whatever blocks, tools, tool choices, schemas and values arrive, the answer is a 200 or a 4xx in
Anthropic's error shape, never a 5xx, and the server stays healthy."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is a development tool the serving lane does not install")
httpx2 = pytest.importorskip("httpx2")

from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.fronts.server_harness import templated_server  # noqa: E402
from tests.fronts.test_http_fuzz import json_values, schema  # noqa: E402

pytestmark = pytest.mark.slow

TEMPLATE = ("{# <tool_call> #}{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
            "{% for m in messages %}{{ m.content }}\n{% endfor %}{% if enable_thinking is not false %}<think>{% endif %}")
names = st.one_of(st.sampled_from(["f", "g"]), st.text(max_size=6))
text = st.text(max_size=20)


def maybe(strategy):
    """Mostly `strategy`, else any JSON value in its place."""
    return st.one_of(strategy, strategy, strategy, json_values)


blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe(text)}, optional={"cache_control": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": maybe(st.sampled_from(["t1", "t2"])), "name": names,
                           "input": maybe(st.dictionaries(st.text(max_size=3), json_values, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": maybe(st.sampled_from(["t1", "t2"]))},
                          optional={"content": maybe(text), "is_error": json_values}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": maybe(text)}, optional={"signature": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["redacted_thinking", "image", "x"])},
                          optional={"data": json_values, "source": json_values}),
    json_values)
message = maybe(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                       "content": st.one_of(text, st.lists(blocks, max_size=3), json_values)}))
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text})
turns = st.one_of(  # well formed: each block where it belongs
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(text, st.lists(st.one_of(text_block, (
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["t1", "t2"]),
                               "content": text}))), max_size=2))}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(text, st.lists(st.one_of(
        text_block, st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", "t2"]), "name": names,
                               "input": st.dictionaries(st.text(max_size=3), json_values, max_size=2)})),
        max_size=2))}))
conversations = st.builds(lambda history, last: [*history, {"role": "user", "content": last}],
                          st.lists(turns, max_size=2), text)
FIELDS = {
    "model": st.one_of(st.just(""), st.text(max_size=8), json_values),
    "max_tokens": st.one_of(st.integers(-1, 4), json_values),
    "system": st.one_of(text, st.lists(maybe(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
                                       max_size=2), json_values),
    "tools": maybe(st.lists(maybe(st.fixed_dictionaries({"name": names, "input_schema": maybe(schema)},
                                                        optional={"description": json_values,
                                                                  "type": json_values})), max_size=3)),
    "tool_choice": maybe(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                               optional={"name": names, "disable_parallel_tool_use": json_values})),
    "thinking": maybe(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "adaptive", "disabled"])},
                                            optional={"budget_tokens": json_values})),
    "output_config": maybe(st.fixed_dictionaries({"format": maybe(st.fixed_dictionaries(
        {"type": st.just("json_schema"), "schema": maybe(schema)}))})),
    "stop_sequences": maybe(st.lists(st.text(max_size=4), max_size=3)),
    "temperature": maybe(st.floats(-1, 3)), "top_p": maybe(st.floats(-0.5, 1.5)), "top_k": maybe(st.integers(-2, 50)),
    "stream": maybe(st.booleans()), "metadata": json_values, "unknown_field": json_values,
}


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
    chosen = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=6))
    if path == "/v1/messages/count_tokens":
        chosen.discard("max_tokens")  # only /v1/messages takes it
    messages = draw(st.one_of(conversations, conversations, st.lists(message, min_size=1, max_size=3), json_values))
    body = {"messages": messages, **({"max_tokens": 3} if path == "/v1/messages" else {}),
            **{name: draw(FIELDS[name]) for name in sorted(chosen)}}
    if draw(st.integers(0, 9)) == 5:
        body = draw(json_values)  # not even an object
    return path, body


def test_no_messages_body_gets_a_5xx(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("messages_fuzz"), TEMPLATE) as srv, \
            httpx2.Client(base_url=srv.http_url, timeout=120) as h:

        @hsettings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
        @given(bodies())
        def one(case):
            path, body = case
            r = h.post(path, content=json.dumps(body))
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code >= 400:
                answer = r.json()
                assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, (body, answer)
                assert answer["error"]["message"], (body, answer)

        one()
        assert h.get("/health").status_code == 200
