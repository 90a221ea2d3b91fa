"""OpenAI's Responses API (`POST /v1/responses`): the request read into a chat request (input items, refusals named
as the Responses body spells its fields), the Response built whole and as events that the `openai` SDK's stream
helper accumulates into the same response; then, driven by the real `openai` client against live servers, a
Response is the chat completion of the same conversation (one engine, one template), streamed or whole, with
function calls that round trip, structured output that parses and reasoning apart; and docs/api.md's
Responses field table walked against the schema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.fronts.chat_output import OutputReader
from service.fronts.http.request_body import validated
from service.fronts.http.responses_body import ResponsesBody
from service.fronts.http.responses_schema import ResponsesRequest, responses_error, sealed, unsealed
from service.fronts.reasoning import ReasoningParser
from service.fronts.status import HttpStatus
from service.fronts.tool_calls import ToolCallParser
from service.fronts.validation import AcceptedRequest

openai = pytest.importorskip("openai", reason="the openai client is a test tool of the HTTP front")

from openai.lib.streaming.responses._responses import ResponseStreamState  # noqa: E402
from openai.types.responses import ResponseStreamEvent  # noqa: E402

from service.client import Client  # noqa: E402
from tests.fronts.server_harness import (  # noqa: E402
    ServerThread,
    engine_for,
    free_port,
    settings,
    slowed,
    templated_server,
    with_chat_template,
)
from tests.fronts.test_http_api import oai  # noqa: E402
from tests.fronts.test_reasoning import SERVER_TEMPLATE as REASONING_TEMPLATE  # noqa: E402
from tests.fronts.test_structured_output import Pet  # noqa: E402
from tests.fronts.test_tool_calls import DRY, SHORT  # noqa: E402
from tests.fronts.test_tool_calls import SERVER_TEMPLATE as TOOLS_TEMPLATE  # noqa: E402

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# each message as its role's initial and its content: a conversation of several turns fits the 128 tokens
TEMPLATE = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def request(body: dict[str, Any]) -> ResponsesRequest:
    """`body` as the server reads it, refusals included."""
    parsed = validated(ResponsesRequest, body)
    parsed.refuse_unsupported()
    return parsed


# ---- the request -------------------------------------------------------------------------------------

def test_input_items_become_the_chat_messages_the_template_reads():
    body = request({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Rain?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "rain", "arguments": '{"c": "P"}', "id": "fc_1"},
        {"type": "function_call", "call_id": "call_2", "name": "dry", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "yes"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "no"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Now "}, {"type": "input_text", "text": "sum up."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "dropped: no turn follows"}]},
    ]})
    assert body.chat_request().conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Rain?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "rain", "arguments": {"c": "P"}}},
            {"id": "call_2", "type": "function", "function": {"name": "dry", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "yes"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no"},
        {"role": "system", "content": "Now sum up."},
    ]
    assert request({"input": "Hi"}).chat_request().conversation() == [{"role": "user", "content": "Hi"}]


def test_the_other_fields_become_the_chat_requests():
    chat = request({"input": "x", "max_output_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
                    "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
                    "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
                    "reasoning": {"effort": "none"}}).chat_request()
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == (5, 0.5, 0.9, False)
    assert chat.tools[0].model_dump(exclude_unset=True) == {
        "type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.reasoning_effort == "none" and chat.template_variables()["enable_thinking"] is False
    assert request({"input": "x", "reasoning": {"effort": "high"}}).chat_request().template_variables() == \
        {"enable_thinking": True, "reasoning_effort": "high"}
    assert request({"input": "x", "text": {"format": {"type": "json_object"}}}).chat_request().response_format.type \
        == "json_object"


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include[1]"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"}, {"role": "user", "content": "x"}]},
     "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": sealed("a")[:-2] + "!!"}]},
     "input[0].encrypted_content"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": [3]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
])
def test_a_refusal_names_the_field_as_the_body_spells_it(body, param):
    with pytest.raises(InvalidRequest) as e:
        request({"input": "x", **body}).chat_request()
    assert responses_error(e.value).field == param, e.value


def test_a_chat_requests_error_is_renamed_with_the_fields_it_mentions():
    cases = [(InvalidRequest("max_tokens", "prompt 4 tokens + max_tokens 200 exceed the context of 128; lower "
                             "max_tokens to at most 124"),
              "max_output_tokens: prompt 4 tokens + max_output_tokens 200 exceed the context of 128; lower "
              "max_output_tokens to at most 124"),
             (InvalidRequest("tool_choice", "a request takes one constraint, and response_format sets one already"),
              "tool_choice: a request takes one constraint, and text.format sets one already"),
             (InvalidRequest("response_format.json_schema.schema", "does not compile"),
              "text.format.schema: does not compile"),
             (InvalidRequest("messages", "the chat template refused them"), "input: the chat template refused them")]
    for error, renamed in cases:
        assert str(responses_error(error)) == renamed


# ---- the Response, whole and streamed ---------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
READER = OutputReader(ToolCallParser("hermes", {"get_weather"}), ReasoningParser())


class Names:
    """`TokenTexts` as the builder uses it, a token named by its id."""

    def openai_logprob(self, token_id: int, logprob: float, top=None) -> dict[str, Any]:
        return {"token": str(token_id), "logprob": logprob, "bytes": [], "top_logprobs": []}


def builder(reader: OutputReader | None = READER, logprobs: bool = False) -> ResponsesBody:
    accepted = AcceptedRequest(GenerationRequest("r", [1, 2, 3], logprobs=logprobs), "r", "", False)
    return ResponsesBody("m", accepted, reader, request({"input": "x"}).echo(), Names())


def events(text: str, step: int = 3, finish: FinishReason = FinishReason.EOS) -> list[TokenEvent]:
    parts = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    return [TokenEvent("r", 0, 7, None, None, part, finish if i == len(parts) - 1 else None)
            for i, part in enumerate(parts)]


def streamed(b: ResponsesBody, token_events: list[TokenEvent], fail: HttpStatus | None = None) -> list[dict]:
    """The events of `b`'s stream, each checked to be framed as its type says."""
    chunks = b.stream_head() + b.chunks(0, token_events) + (b.stream_error(fail) if fail else b.stream_tail())
    out = []
    for chunk in chunks:
        head, data, *rest = chunk.decode().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and rest == ["", ""]
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def accumulated(stream_events: list[dict]):
    """What the SDK's stream helper makes of the events (it refuses events out of order); its final response."""
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for event in stream_events:
        state.handle_event(openai._models.construct_type(type_=ResponseStreamEvent, value=event))
    return state._completed_response


def shape(output: list) -> list[tuple]:
    """The output items without their ids."""
    def text(item):
        return "".join(part["text"] for part in item["content"])
    items = [item if isinstance(item, dict) else item.to_dict() for item in output]
    return [(i["type"], i["status"], i.get("name"), i.get("arguments"), text(i) if "content" in i else None)
            for i in items]


@pytest.mark.parametrize("step", [1, 3, 7, 200])
def test_the_output_is_reasoning_message_and_calls_whole_and_streamed_alike(step):
    output = f"<think>\nWeather needed.\n</think>\n\nChecking.{CALL}"
    whole = builder()
    whole.add(0, events(output, step))
    response = whole.response()
    assert shape(response["output"]) == [
        ("reasoning", "completed", None, None, "Weather needed."), ("message", "completed", None, None, "Checking."),
        ("function_call", "completed", "get_weather", '{"city": "Paris"}', None)]
    assert response["status"] == "completed" and response["incomplete_details"] is None
    usage = response["usage"]
    assert usage["output_tokens"] == len(events(output, step)) and usage["input_tokens"] == 3
    section_end = output.index("</think>") + len("</think>")  # the tokens up to the one that closes the section
    assert usage["output_tokens_details"]["reasoning_tokens"] == -(-section_end // step)
    stream = streamed(builder(), events(output, step))
    assert [e["type"] for e in stream[:4]] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added"]
    assert stream[0]["response"]["status"] == "in_progress" and stream[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in stream if e["type"] == "response.reasoning_text.delta") == "Weather needed."
    assert "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta") == "Checking."
    assert [e["arguments"] for e in stream if e["type"] == "response.function_call_arguments.done"] == \
        ['{"city": "Paris"}']
    final = accumulated(stream)
    assert stream[-1]["type"] == "response.completed" and final.output_text == "Checking."
    assert shape(final.output) == shape(response["output"])


def test_a_response_cut_off_by_max_output_tokens_is_incomplete():
    b = builder()
    b.add(0, events("<think>\nStill thinking", finish=FinishReason.LENGTH))
    response = b.response()
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert shape(response["output"]) == [("reasoning", "incomplete", None, None, "Still thinking")]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == response["usage"]["output_tokens"]
    stream = streamed(builder(None), events("Cut", finish=FinishReason.LENGTH))
    assert stream[-1]["type"] == "response.incomplete" and stream[-1]["response"]["status"] == "incomplete"
    assert shape(stream[-1]["response"]["output"]) == [("message", "incomplete", None, None, "Cut")]


def test_an_output_of_nothing_is_one_empty_message():
    b = builder(None)
    b.add(0, events(""))
    assert shape(b.response()["output"]) == [("message", "completed", None, None, "")]
    assert b.response()["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_a_stream_that_fails_ends_with_an_error_and_response_failed():
    stream = streamed(builder(None), events("Part"), fail=HttpStatus(408, "timeout_error", "the deadline passed"))
    error, failed = stream[-2:]
    assert error == {"type": "error", "code": "timeout", "message": "the deadline passed", "param": None,
                     "sequence_number": error["sequence_number"]}
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "timeout", "message": "the deadline passed"}
    assert failed["response"]["usage"] is None


# ---- live: the chat template's server --------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_server(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("responses"), TEMPLATE) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(chat_server):
    with oai(chat_server) as c:
        yield c


def test_each_answer_token_logprob_goes_with_the_text_it_wrote():
    """Reasoning and calls carry no logprobs; markup and held-back text go with the answer text after them;
    the end of sequence with the answer it ends."""
    pieces = ["<think>", "wh", "y", "</think>", "Sun", "ny", "<tool", "_call>", CALL.removeprefix("<tool_call>"),
              "Then", " rain", ""]
    token_events = [TokenEvent("r", 0, i, -0.5, [], text, FinishReason.EOS if i == len(pieces) - 1 else None)
                    for i, text in enumerate(pieces)]
    b = builder(logprobs=True)
    stream = streamed(b, token_events)
    messages = [item for item in b.response()["output"] if item["type"] == "message"]
    assert [m["content"][0]["text"] for m in messages] == ["Sunny", "Then rain"]
    assert [[lp["token"] for lp in m["content"][0]["logprobs"]] for m in messages] == \
        [["3", "4", "5"], ["9", "10", "11"]]
    deltas = [e for e in stream if e["type"] == "response.output_text.delta"]
    assert [(e["delta"], [lp["token"] for lp in e["logprobs"]]) for e in deltas] == \
        [("Sun", ["3", "4"]), ("ny", ["5"]), ("Then", ["9"]), (" rain", ["10"]), ("", ["11"])]
    done = [e["logprobs"] for e in stream if e["type"] == "response.output_text.done"]
    assert [[lp["token"] for lp in logprobs] for logprobs in done] == [["3", "4", "5"], ["9", "10", "11"]]
    assert all(item["content"][0]["logprobs"] == [] for item in builder().response()["output"]
               if item["type"] == "message")


def test_logprobs_are_the_chat_completions_when_included(api):
    fields = dict(model="", input="Rain?", max_output_tokens=8, temperature=0)
    chat = api.chat.completions.create(model="", messages=[{"role": "user", "content": "Rain?"}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    response = api.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, **fields)
    part = response.output[0].content[0]
    assert [lp.model_dump() for lp in part.logprobs] == [lp.model_dump() for lp in chat]
    assert all(len(lp.top_logprobs) == 3 for lp in part.logprobs) and response.top_logprobs == 3
    streamed_events = list(api.responses.create(stream=True, include=["message.output_text.logprobs"],
                                                top_logprobs=3, **fields))
    sent = [lp.model_dump() for e in streamed_events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert sent == [lp.model_dump(exclude={"bytes": True, "top_logprobs": {"__all__": {"bytes"}}}) for lp in chat]
    done, = [e.logprobs for e in streamed_events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done] == sent
    assert api.responses.create(top_logprobs=3, **fields).output[0].content[0].logprobs == []  # not included


def test_a_response_is_the_chat_completion_of_the_same_conversation(api):
    conversations = [
        ("Rain?", {}, [{"role": "user", "content": "Rain?"}]),
        ([{"role": "user", "content": "Rain?"}, {"role": "assistant", "content": "No."},
          {"role": "developer", "content": [{"type": "input_text", "text": "Snow?"}]}], {"instructions": "Be"},
         [{"role": "system", "content": "Be"}, {"role": "user", "content": "Rain?"},
          {"role": "assistant", "content": "No."}, {"role": "system", "content": "Snow?"}]),
    ]
    for given, extra, messages in conversations:
        response = api.responses.create(model="", input=given, max_output_tokens=8, temperature=0, **extra)
        chat = api.chat.completions.create(model="", messages=messages, max_tokens=8, temperature=0)
        assert response.output_text == chat.choices[0].message.content
        assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert (response.usage.input_tokens, response.usage.output_tokens) == \
            (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert response.usage.total_tokens == chat.usage.total_tokens
        assert response.object == "response" and response.id.startswith("resp_") and response.model == chat.model
        assert (response.instructions, response.max_output_tokens, response.temperature, response.store) == \
            (extra.get("instructions"), 8, 0.0, False)


def test_a_stream_adds_up_to_the_whole_response(api):
    fields = dict(model="", input="Rain?", max_output_tokens=10, temperature=0)
    whole = api.responses.create(**fields)
    stream_events = list(api.responses.create(stream=True, **fields))
    types = [e.type for e in stream_events]
    text_events = ["response.output_item.added", "response.content_part.added"]
    assert types[:4] == ["response.created", "response.in_progress", *text_events]
    deltas = [e.delta for e in stream_events if e.type == "response.output_text.delta"]
    assert types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in stream_events] == list(range(len(stream_events)))
    assert "".join(deltas) == whole.output_text == stream_events[-1].response.output_text
    assert stream_events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_parse_and_the_stream_helper_give_a_validated_object(api):
    for temperature in (0, 1.0, 1.0):
        out = api.responses.parse(model="", input="a pet", text_format=Pet, max_output_tokens=60,
                                  temperature=temperature)
        assert out.status == "completed" and isinstance(out.output_parsed, Pet)
        assert Pet.model_validate_json(out.output_text) == out.output_parsed
        assert out.text.format.type == "json_schema" and out.text.format.name == "Pet"
    with api.responses.stream(model="", input="a pet", text_format=Pet, max_output_tokens=60, temperature=0) as s:
        final = s.get_final_response()
    whole = api.responses.parse(model="", input="a pet", text_format=Pet, max_output_tokens=60, temperature=0)
    assert final.output_parsed == whole.output_parsed and final.output_text == whole.output_text


def test_json_object_is_chats_json_mode(api):
    """Any JSON object is unbounded: the output may be cut off inside it (as chat's may, docs/api.md)."""
    out = api.responses.create(model="", input="json", text={"format": {"type": "json_object"}},
                               max_output_tokens=60, temperature=0)
    chat = api.chat.completions.create(model="", messages=[{"role": "user", "content": "json"}], max_tokens=60,
                                       temperature=0, response_format={"type": "json_object"})
    assert out.output_text == chat.choices[0].message.content and out.output_text.startswith("{")
    if out.status == "completed":
        assert isinstance(json.loads(out.output_text), dict)


def test_max_output_tokens_reached_is_incomplete(api):
    out = api.responses.create(model="", input="Rain?", max_output_tokens=3, temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[-1].status == "incomplete"


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"max_output_tokens": 1000}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
     "input[0].content[0].type"),
])
def test_a_bad_request_is_a_400_naming_the_field(api, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.create(**{"model": "", "input": "Rain?", **fields})
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(param + ": ")


def test_the_model_is_checked_and_nothing_is_stored(api):
    with pytest.raises(openai.NotFoundError) as e:
        api.responses.create(model="nope", input="Rain?")
    assert e.value.body["param"] == "model"
    for ask in (api.responses.retrieve, api.responses.delete):
        with pytest.raises(openai.NotFoundError) as e:
            ask("resp_1")
        assert e.value.body["param"] == "response_id" and "stateless" in e.value.body["message"]


def test_the_token_guards_it_and_a_stream_that_fails_ends_with_response_failed(engine_bundle, tmp_path):
    bundle = with_chat_template(engine_bundle, tmp_path, TEMPLATE)
    s = settings(bundle, http_port=free_port(), auth_token="s3cret", warmup=False)
    with ServerThread(s, engine=engine_for(s, slowed(0.05))) as srv:
        with oai(srv, key="wrong") as api, pytest.raises(openai.AuthenticationError):
            api.responses.create(model="", input="Rain?", max_output_tokens=2)
        with oai(srv, key="s3cret") as api:
            stream_events = list(api.responses.create(model="", input="Rain?", max_output_tokens=100, temperature=0,
                                                      stream=True, extra_headers={"X-Request-Timeout": "0.3"}))
    types = [e.type for e in stream_events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-2:] == ["error", "response.failed"]
    assert stream_events[-2].code == "timeout" and stream_events[-1].response.status == "failed"
    assert stream_events[-1].response.error.code == "timeout"


# ---- live: tools ------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
         for t in (SHORT, DRY)]


@pytest.fixture(scope="module")
def tool_api(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("responses-tools"), TOOLS_TEMPLATE) as srv, oai(srv) as api, Client(srv.address) as grpc:
        yield api, grpc


def test_a_function_call_round_trips(tool_api):
    api, grpc = tool_api
    fields = dict(model="", tools=TOOLS, temperature=0, max_output_tokens=100)
    first = api.responses.create(input="Rain?", tool_choice={"type": "function", "name": "rain"},
                                 parallel_tool_calls=False, **fields)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "rain" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    assert first.tool_choice.name == "rain" and [t.name for t in first.tools] == ["rain", "dry"]
    follow_up = api.responses.create(input=[{"role": "user", "content": "Rain?"}, *first.output,
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], **{**fields, "max_output_tokens": 4})
    # the template writes the tools' names, then each message's content: the call's is empty, its output "sunny"
    assert follow_up.usage.input_tokens == len(grpc.tokenize("rain dry Rain?\n\nsunny\n").token_ids)
    assert follow_up.output[-1].type == "message"


def test_a_streamed_call_accumulates_to_the_whole_one(tool_api):
    api, _ = tool_api
    fields = dict(model="", input="Rain?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_output_tokens=100)
    whole = api.responses.create(**fields)
    with api.responses.stream(**fields) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types.count("response.function_call_arguments.delta") == 1
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in whole.output]
    assert whole.output and all(c.type == "function_call" for c in whole.output)


# ---- live: reasoning --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reasoning_api(engine_bundle, tmp_path_factory):
    bundle = with_chat_template(engine_bundle, tmp_path_factory.mktemp("responses-reasoning"),
                                REASONING_TEMPLATE)
    with ServerThread(settings(bundle, http_port=free_port())) as srv, oai(srv) as api:
        yield api


@pytest.mark.parametrize("effort", [None, "none"])
def test_reasoning_is_its_own_item_as_the_chat_message_reads_it(reasoning_api, effort):
    """The prompt opens the section unless enable_thinking is false (effort "none"); the answer is what follows."""
    extra = {"reasoning": {"effort": effort}} if effort else {}
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if effort == "none" else {}
    response = reasoning_api.responses.create(model="", input="Rain?", max_output_tokens=12, temperature=0, **extra)
    chat = reasoning_api.chat.completions.create(model="", messages=[{"role": "user", "content": "Rain?"}],
                                                 max_tokens=12, temperature=0, extra_body=kwargs)
    message = chat.choices[0].message
    reasoning = [item.content[0].text for item in response.output if item.type == "reasoning"]
    assert reasoning == ([message.reasoning_content] if message.reasoning_content else [])
    assert response.output_text == (message.content or "")
    assert (response.usage.output_tokens_details.reasoning_tokens > 0) == bool(reasoning)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    if effort is None:
        assert reasoning, "the prompt opened the section: the output begins as reasoning"
    stream_events = list(reasoning_api.responses.create(stream=True, model="", input="Rain?", max_output_tokens=12,
                                                        temperature=0, **extra))
    assert "".join(e.delta for e in stream_events if e.type == "response.reasoning_text.delta") == \
        "".join(reasoning)
    assert "".join(e.delta for e in stream_events if e.type == "response.output_text.delta") == response.output_text


def test_sealed_reasoning_comes_back_as_the_reasoning_it_holds(reasoning_api):
    """A client that keeps nothing on the server sends the sealed reasoning back, and the next turn reads it as it
    would the reasoning's text."""
    response = reasoning_api.responses.create(model="", input="Rain?", max_output_tokens=12, temperature=0,
                                              include=["reasoning.encrypted_content"])
    item, = [item for item in response.output if item.type == "reasoning"]
    assert unsealed(item.encrypted_content, "x") == item.content[0].text != ""
    assert reasoning_api.responses.create(model="", input="Rain?", max_output_tokens=12, temperature=0).output[0] \
        .encrypted_content is None  # not included
    turn = [{"role": "user", "content": "Rain?"}, None, {"role": "assistant", "content": "No."},
            {"role": "user", "content": "Snow?"}]
    as_sent = {"type": "reasoning", "summary": [], "encrypted_content": item.encrypted_content}
    as_text = {"type": "reasoning", "summary": [],
               "content": [{"type": "reasoning_text", "text": item.content[0].text}]}
    sent, text = ([*turn[:1], reasoning, *turn[2:]] for reasoning in (as_sent, as_text))
    assert request({"input": sent}).messages() == request({"input": text}).messages()
    assert request({"input": sent}).messages()[1]["reasoning_content"] == item.content[0].text
    answers = [reasoning_api.responses.create(model="", input=given, max_output_tokens=4, temperature=0)
               for given in (sent, text)]
    assert answers[0].usage.input_tokens == answers[1].usage.input_tokens


def test_sealed_text_reads_back_whole():
    for text in ("", "why", "ünïcode 雨\n<think>"):
        assert unsealed(sealed(text), "x") == text


# ---- docs/api.md's field table -----------------------------------------------------------------------------

# a valid value of each documented field, sent alone on top of a minimal body
ACCEPTED = {
    "model": "", "input": [{"role": "user", "content": "x"}], "instructions": "Be", "max_output_tokens": 3,
    "temperature": 0.5, "top_p": 0.9, "tools": [{"type": "function", "name": "f"}], "tool_choice": "none",
    "parallel_tool_calls": False, "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low", "summary": "auto"},
    "stream": False, "include": ["message.output_text.logprobs"], "top_logprobs": 2, "truncation": "disabled", "store": True, "metadata": {"k": "v"}, "user": "u1",
    "previous_response_id": None, "conversation": None, "max_tool_calls": 3, "safety_identifier": "u1",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "service_tier": "priority",
    "stream_options": {"include_obfuscation": False},
}
# the refusals the table documents: (value, the param the 400 names)
REFUSED = {"previous_response_id": ("resp_1", "previous_response_id"), "conversation": ("conv_1", "conversation"),
           "truncation": ("auto", "truncation"), "include": (["file_search_call.results"], "include[0]")}


def documented() -> set[str]:
    text = API_DOC.read_text()
    table = text[text.index("| Responses field | type |"):]
    table = table[:table.index("\n\n")]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def test_the_table_lists_exactly_the_fields_the_endpoint_takes():
    assert documented() == {info.alias or name for name, info in ResponsesRequest.model_fields.items()}


def post(api, extra: dict) -> dict:
    return api.post("/responses", body={"input": "hi", "max_output_tokens": 2, **extra}, cast_to=object)


def test_every_documented_field_is_accepted_and_every_documented_refusal_names_its_field(api):
    for field in sorted(documented()):
        answer = post(api, {field: ACCEPTED[field]})
        assert answer["object"] == "response" and answer["output"], (field, answer)
    for field, (value, param) in REFUSED.items():
        with pytest.raises(openai.BadRequestError) as e:
            post(api, {field: value})
        assert e.value.body["param"] == param, (field, e.value.body)


@pytest.mark.parametrize("field", ["frobnicate", "seed", "messages", "background"])
def test_a_field_the_table_does_not_list_is_refused_by_name(api, field):
    with pytest.raises(openai.BadRequestError) as e:
        post(api, {field: 1})
    assert e.value.body["param"] == field and "not a field this server implements" in e.value.body["message"]


# ---- fuzz -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_no_responses_body_gets_a_5xx(chat_server):
    """Whatever JSON arrives in whatever field or item: a 200 (whole, or a stream that ends with a terminal
    event) or a 4xx in OpenAI's shape, never a 5xx; the server stays healthy."""
    pytest.importorskip("hypothesis", reason="hypothesis is a development tool the serving lane does not install")
    httpx2 = pytest.importorskip("httpx2")
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings
    from hypothesis import strategies as st

    from tests.fronts.test_http_fuzz import json_values

    def maybe(strategy):
        return st.one_of(strategy, json_values)

    parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"])},
                                           optional={"text": maybe(st.text(max_size=10))}), max_size=2)
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])},
                              optional={"type": st.sampled_from(["message", "x"]),
                                        "content": maybe(st.one_of(st.text(max_size=20), parts))}),
        st.fixed_dictionaries({"type": st.just("function_call")}, optional={
            "call_id": maybe(st.just("c1")), "name": maybe(st.sampled_from(["f", "g"])),
            "arguments": maybe(st.sampled_from(['{"a": 1}', "[]", "{", ""]))}),
        st.fixed_dictionaries({"type": st.just("function_call_output")},
                              optional={"call_id": maybe(st.just("c1")), "output": maybe(st.text(max_size=10))}),
        st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"])},
                              optional={"summary": json_values, "content": maybe(st.lists(st.fixed_dictionaries(
                                  {"type": st.just("reasoning_text"), "text": st.text(max_size=10)}), max_size=2))}),
        json_values)
    fields = {
        "model": st.one_of(st.none(), st.just(""), st.text(max_size=12)),
        "input": maybe(st.one_of(st.text(max_size=40), st.lists(item, max_size=4))),
        "instructions": maybe(st.text(max_size=20)),
        "max_output_tokens": maybe(st.integers(-2, 8)),
        "temperature": maybe(st.floats(-1, 3)), "top_p": maybe(st.floats(-0.5, 1.5)),
        "tools": maybe(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                       "name": st.one_of(st.sampled_from(["f", "g"]), st.text(max_size=8))},
                                                      optional={"parameters": json_values}), max_size=2)),
        "tool_choice": maybe(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}])),
        "parallel_tool_calls": maybe(st.booleans()),
        "text": maybe(st.fixed_dictionaries({"format": maybe(st.one_of(
            st.just({"type": "json_object"}), st.just({"type": "text"}),
            st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("x"), "schema": json_values})))})),
        "reasoning": maybe(st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "x"])})),
        "stream": maybe(st.booleans()), "include": json_values, "truncation": json_values, "store": json_values,
        "metadata": json_values, "user": json_values, "previous_response_id": json_values, "unknown_field": json_values,
    }

    with httpx2.Client(base_url=chat_server.http_url, timeout=120) as h:

        @hsettings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
        @given(st.sets(st.sampled_from(sorted(fields)), max_size=8).flatmap(
            lambda chosen: st.fixed_dictionaries({name: fields[name] for name in sorted(chosen)})))
        def one(body):
            r = h.post("/v1/responses", content=json.dumps(body))
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
            elif r.headers["content-type"].startswith("text/event-stream"):
                kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
                assert kinds[-1] in ("response.completed", "response.incomplete"), (body, kinds)
            else:
                assert r.json()["status"] in ("completed", "incomplete"), (body, r.text)

        one()
        assert h.get("/health").status_code == 200
