"""docs/api.md's table of the Messages API's fields, walked against both of its endpoints as
test_request_fields.py walks the OpenAI table: every field the schemas take is documented and every documented
field is taken; each is accepted with a valid value, the documented refusals are 400s naming the field, and
a field the table does not list is refused by name."""

from __future__ import annotations

import re

import anthropic
import pytest

from service.fronts.http.anthropic_schema import CountTokensRequest, MessagesRequest
from tests.fronts.server_harness import templated_server
from tests.fronts.test_http_api import CHATML
from tests.fronts.test_request_fields import API_DOC, schema_fields

USER = [{"role": "user", "content": "hi"}]
ENDPOINTS = {"messages": ("/v1/messages", MessagesRequest, {"messages": USER, "max_tokens": 2}),
             "count_tokens": ("/v1/messages/count_tokens", CountTokensRequest, {"messages": USER})}
TOOL = {"name": "f", "input_schema": {"type": "object"}}

# a valid value of each documented field (with what it needs beside it), sent on top of a minimal body
ACCEPTED = {
    "model": {"model": ""}, "messages": {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
    "system": {"system": "Be brief."}, "tools": {"tools": [TOOL]},
    "tool_choice": {"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    "output_config": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    "cache_control": {"cache_control": {"type": "ephemeral"}}, "max_tokens": {"max_tokens": 3},
    "stream": {"stream": False}, "stop_sequences": {"stop_sequences": ["zz"]}, "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9}, "top_k": {"top_k": 5}, "metadata": {"metadata": {"user_id": "u1"}},
    "service_tier": {"service_tier": "auto"},
}
# the refusals the table documents, each naming its field
REFUSED = {
    "messages": ([*USER, {"role": "assistant", "content": "Sure "}], "messages[1].content"),
    "tools": ([{"type": "web_search_20250305", "name": "web_search"}], "tools[0].type"),
    "tool_choice": ({"type": "any"}, "tool_choice"),
    "output_config": ({"effort": "low"}, "output_config.effort"),
}


def documented() -> dict[str, set[str]]:
    """endpoint -> the fields the table lists for it."""
    text = API_DOC.read_text()
    table = text[text.index("| Messages field | count_tokens |"):]
    table = table[:table.index("\n\n")]
    fields: dict[str, set[str]] = {"messages": set(), "count_tokens": set()}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        names = re.findall(r"`([a-z_]+)`", cells[0])
        fields["messages"].update(names)
        if cells[1] == "yes":
            fields["count_tokens"].update(names)
    return fields


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_table_lists_exactly_the_fields_each_endpoint_takes(endpoint):
    assert documented()[endpoint] == schema_fields(ENDPOINTS[endpoint][1])


@pytest.fixture(scope="module")
def api(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("messages_fields"), CHATML) as srv:
        with anthropic.Anthropic(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=60) as client:
            yield client


def post(api: anthropic.Anthropic, endpoint: str, extra: dict) -> dict:
    path, _, base = ENDPOINTS[endpoint]
    return api.post(path, body={**base, **extra}, cast_to=object)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_documented_field_is_accepted_with_a_valid_value(api, endpoint):
    for field in sorted(documented()[endpoint]):
        answer = post(api, endpoint, ACCEPTED[field])
        assert (answer["content"] if endpoint == "messages" else answer["input_tokens"]), (field, answer)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_documented_refusals_name_their_field(api, endpoint):
    for field, (value, named) in REFUSED.items():
        with pytest.raises(anthropic.BadRequestError) as e:
            post(api, endpoint, {field: value})
        assert e.value.body["error"]["message"].startswith(f"{named}: "), (field, e.value.body)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", ["frobnicate", "container", "mcp_servers", "inference_geo", "speed"])
def test_a_field_the_table_does_not_list_is_refused_by_name(api, endpoint, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        post(api, endpoint, {field: 1})
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        f"{field}: is not a field this server implements; remove it (docs/api.md lists every field and what the "
        "server does with it)")}}


def test_count_tokens_refuses_what_only_a_message_takes(api):
    with pytest.raises(anthropic.BadRequestError) as e:
        post(api, "count_tokens", {"max_tokens": 4})
    assert e.value.body["error"]["message"].startswith("max_tokens: is not a field")
