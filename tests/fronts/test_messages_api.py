"""Anthropic's Messages API on the HTTP front, checked with Anthropic's own client: a message and its stream
(the client's accumulation of the stream gives the whole message) agree with /v1/chat/completions on the same
conversation; stop sequences; a tool round trip; structured output with `messages.parse`; reasoning apart;
count_tokens; and errors in Anthropic's shape, from the body, the token guard, the model name, a full queue
and a deadline that passes mid-stream. Without a server: the translation into a chat request, and the
builder's stream against its whole message through the client's own stream accumulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import anthropic
import httpx2
import jsonschema
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from pydantic import BaseModel

from service.client import Client
from service.engine.errors import InvalidRequest
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.engine.sequence import Timing
from service.fronts.chat_output import OutputReader
from service.fronts.http.anthropic_responses import MessageBuilder
from service.fronts.http.anthropic_schema import MessagesRequest
from service.fronts.http.openai_schema import ChatCompletionRequest
from service.fronts.http.request_body import validated
from service.fronts.reasoning import ReasoningParser
from service.fronts.tool_calls import ToolCallParser
from service.fronts.validation import AcceptedRequest
from service.runtime.chat_template import ChatTemplate
from tests.fronts.server_harness import (
    ServerThread,
    engine_for,
    free_port,
    settings,
    slowed,
    templated_server,
    with_chat_template,
)
from tests.fronts.test_http_api import CHATML, oai
from tests.fronts.test_reasoning import SERVER_TEMPLATE as REASONING_TEMPLATE
from tests.fronts.test_tool_calls import SERVER_TEMPLATE as TOOLS_TEMPLATE

USER = [{"role": "user", "content": "Rain?"}]
RAIN = {"name": "rain", "description": "Whether it rains", "input_schema": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}, "required": ["c"],
    "additionalProperties": False}}
GREEDY = {"temperature": 0}  # the anthropic client takes no sampling arguments: they go in the body as they are
DRY = {"name": "dry", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}


def claude(srv: ServerThread, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.http_url, api_key=key, max_retries=0, timeout=60)


def post(srv: ServerThread, path: str, body: dict, **kwargs) -> httpx2.Response:
    with httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        return h.post(path, content=json.dumps(body), **kwargs)


def error_of(response: httpx2.Response) -> dict:
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def events_of(response: httpx2.Response) -> list[tuple[str, dict]]:
    """An event stream's (event name, data) pairs, each name checked against its data's type."""
    out = []
    for chunk in response.text.split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
            assert out[-1][0] == out[-1][1]["type"], chunk
    return out


@pytest.fixture(scope="module")
def chat_server(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("messages"), CHATML) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(chat_server):
    with claude(chat_server) as c:
        yield c


# ---- a message, whole and streamed ---------------------------------------------------------------

def test_a_message_is_the_chat_completion_of_the_same_conversation(api, chat_server):
    message = api.messages.create(model="", max_tokens=8, messages=USER, extra_body=GREEDY)
    with oai(chat_server) as o:
        chat = o.chat.completions.create(model="", max_tokens=8, messages=USER, temperature=0)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == chat.model
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_final_assistant_message_is_continued_as_chat_continues_it(api, chat_server):
    """A prefill: the answer goes on from the final assistant message's text, and holds only what follows it."""
    prefill = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "The sky"}, {"type": "text",
                                                                                             "text": " is"}]}]
    message = api.messages.create(model="", max_tokens=8, messages=prefill, extra_body=GREEDY)
    with oai(chat_server) as o:
        chat = o.chat.completions.create(model="", max_tokens=8, temperature=0, messages=[
            *USER, {"role": "assistant", "content": "The sky is"}],
            extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = api.messages.count_tokens(model="", messages=prefill).input_tokens
    assert counted == chat.usage.prompt_tokens
    streamed = api.messages.create(model="", max_tokens=8, messages=prefill, stream=True, extra_body=GREEDY)
    assert "".join(e.delta.text for e in streamed if e.type == "content_block_delta") == message.content[0].text


def test_a_stop_sequence_ends_the_message_and_is_named(api):
    text = api.messages.create(model="", max_tokens=12, messages=USER, extra_body=GREEDY).content[0].text
    assert len(text) >= 6, text  # the greedy answer is long enough to stop inside
    stop = text[4:6]
    message = api.messages.create(model="", max_tokens=12, messages=USER, extra_body=GREEDY,
                                  stop_sequences=["never written", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[:text.find(stop)]


def test_a_streamed_message_accumulates_to_the_whole_one(api):
    fields = dict(model="", max_tokens=10, messages=USER, extra_body=GREEDY)
    whole = api.messages.create(**fields)
    with api.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    # all but the id and the usage's split of the prompt (the second run may find it in the prefix cache)
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_stream_sends_anthropics_events_in_order(api):
    events = [e.type for e in api.messages.create(model="", max_tokens=6, messages=USER, extra_body=GREEDY, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) <= {"content_block_delta"}


def test_count_tokens_is_the_prompt_the_message_runs(api):
    fields = dict(model="", messages=[{"role": "user", "content": [{"type": "text", "text": "Rain?"}]}],
                  system=[{"type": "text", "text": "Be brief."}])
    counted = api.messages.count_tokens(**fields).input_tokens
    usage = api.messages.create(max_tokens=2, **fields).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens
    assert counted > api.messages.count_tokens(model="", messages=USER).input_tokens


# ---- structured output ---------------------------------------------------------------------------

class Weather(BaseModel):
    wet: bool
    sky: Literal["grey", "blue"]


def test_parse_returns_an_object_of_the_output_format(api):
    message = api.messages.parse(model="", max_tokens=60, messages=USER, output_format=Weather)
    assert isinstance(message.parsed_output, Weather), message
    jsonschema.validate(json.loads(message.content[0].text), Weather.model_json_schema())
    assert message.stop_reason == "end_turn"


# ---- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field", [
    ({"frobnicate": 1}, "frobnicate"), ({"temperature": "hot"}, "temperature"), ({"top_k": -5}, "top_k"),
    ({"stop_sequences": ["a", 3]}, "stop_sequences[1]"), ({"max_tokens": 10_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config.format.schema"),
])
def test_a_bad_field_is_a_bad_request_naming_it(api, fields, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        api.messages.create(model="", max_tokens=4, messages=USER, extra_body=fields)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(f"{field}: "), e.value.body


def test_an_unknown_model_is_not_found(api):
    with pytest.raises(anthropic.NotFoundError) as e:
        api.messages.create(model="claude-opus-4", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-opus-4" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        api.messages.count_tokens(model="claude-opus-4", messages=USER)


def test_errors_outside_the_body_have_anthropics_shape_too(chat_server):
    with httpx2.Client(base_url=chat_server.http_url, timeout=60) as h:
        not_json = h.post("/v1/messages", content=b"{")
        assert not_json.status_code == 400 and error_of(not_json)["message"].startswith("body: ")
        wrong_method = h.get("/v1/messages")
        assert wrong_method.status_code == 405 and error_of(wrong_method)["type"] == "invalid_request_error"
        no_path = h.post("/v1/messages/batches", content=b"{}")
        assert no_path.status_code == 404 and error_of(no_path)["type"] == "not_found_error"


def test_the_token_is_taken_from_x_api_key_or_bearer_and_refused_in_anthropics_shape(engine_bundle, tmp_path):
    bundle = with_chat_template(engine_bundle, tmp_path, CHATML)
    body = {"max_tokens": 2, "messages": USER}
    with ServerThread(settings(bundle, http_port=free_port(), auth_token="s3cret")) as srv:
        with claude(srv, key="wrong") as c, pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model="", **body)
        assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]
        with claude(srv, key="s3cret") as c:
            assert c.messages.create(model="", **body).usage.output_tokens == 2
        for headers, status in [({"x-api-key": "s3cret"}, 200), ({"x-api-key": "wrong"}, 401),
                                ({"authorization": "Bearer s3cret"}, 200), ({}, 401)]:
            r = post(srv, "/v1/messages", body, headers={"anthropic-version": "2023-06-01", "anthropic-beta": "any-beta", **headers})
            assert r.status_code == status, (headers, r.text)
            if status == 401:
                assert error_of(r)["type"] == "authentication_error"
        assert post(srv, "/v1/messages/count_tokens", {"messages": USER},
                    headers={"x-api-key": "s3cret"}).json()["input_tokens"] > 0
        assert post(srv, "/v1/completions", {"prompt": "x"}, headers={"x-api-key": "s3cret"}).status_code == 401
        refused = srv.server.metrics.registry.get_sample_value(
            "attnserve_requests_total", {"protocol": "http", "method": "/v1/messages", "code": "401"})
        assert refused == 3


@pytest.mark.slow
def test_a_full_queue_is_529_and_a_deadline_mid_stream_an_error_event(engine_bundle, tmp_path):
    bundle = with_chat_template(engine_bundle, tmp_path, CHATML)
    s = settings(bundle, http_port=free_port(), max_running=1, max_waiting=1, max_batch_tokens=64, warmup=False)
    body = {"max_tokens": 4, "messages": USER}
    with ServerThread(s, engine=engine_for(s, slowed(0.05))) as srv, oai(srv) as o, \
            httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        holder = o.completions.create(model="", prompt="Rain?", max_tokens=100, stream=True,
                                      extra_body={"min_tokens": 100})
        next(iter(holder))  # the one slot is taken, for 100 slowed steps
        with h.stream("POST", "/v1/messages", content=json.dumps({**body, "stream": True}),
                      headers={"X-Request-Timeout": "3"}) as late:  # queued: the one waiting place is taken
            full = h.post("/v1/messages", content=json.dumps(body))
            assert full.status_code == 529 and int(full.headers["retry-after"]) >= 1
            assert error_of(full)["type"] == "overloaded_error"
            assert srv.server.metrics.registry.get_sample_value(  # counted as the client saw it
                "attnserve_requests_total", {"protocol": "http", "method": "/v1/messages", "code": "529"}) == 1
            late.read()
        # its deadline passed in the queue, after its stream began: the stream ends with an error event
        events = events_of(late)
        assert late.status_code == 200 and events[0][0] == "message_start"
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "timeout_error", events
        holder.close()


# ---- tools ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_server(engine_bundle, tmp_path_factory):
    """Its template writes the tools' names and the messages' contents (and names the hermes format)."""
    with templated_server(engine_bundle, tmp_path_factory.mktemp("messages_tools"), TOOLS_TEMPLATE) as srv:
        yield srv


def test_a_tool_round_trip(tool_server):
    fields = dict(model="", max_tokens=100, extra_body=GREEDY, tools=[RAIN, DRY])
    with claude(tool_server) as c, Client(tool_server.address) as grpc:
        called = c.messages.create(messages=USER, tool_choice={"type": "tool", "name": "rain"}, **fields)
        assert called.stop_reason == "tool_use"
        [use] = [block for block in called.content if block.type == "tool_use"]
        assert use.name == "rain" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, RAIN["input_schema"])
        with c.messages.stream(messages=USER, tool_choice={"type": "tool", "name": "rain"}, **fields) as stream:
            streamed = stream.get_final_message()
        assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
            [("tool_use", "rain", use.input)]

        history = [*USER, {"role": "assistant", "content": called.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "wet"}]}]
        answer = c.messages.create(messages=history, **{**fields, "max_tokens": 4})
        assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
        # the template wrote the tools, the question, the call's turn (no text) and the result
        prompt = len(grpc.tokenize("rain dry Rain?\n\nwet\n").token_ids)
        assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == prompt
        assert c.messages.count_tokens(model="", messages=history, tools=[RAIN, DRY]).input_tokens == prompt
        assert c.messages.count_tokens(model="", messages=history, tools=[RAIN, DRY],
                                       tool_choice={"type": "none"}).input_tokens < prompt


# ---- reasoning ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reasoning_server(engine_bundle, tmp_path_factory):
    """Its generation prompt opens a reasoning section unless `enable_thinking` is false."""
    with templated_server(engine_bundle, tmp_path_factory.mktemp("messages_reasoning"), REASONING_TEMPLATE) as srv:
        yield srv


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])
def test_the_reasoning_is_a_thinking_block_and_the_answer_a_text_block(reasoning_server, thinking):
    opened = thinking["type"] == "enabled"
    fields = {"max_tokens": 12, "extra_body": GREEDY}
    with oai(reasoning_server) as o:
        raw = o.completions.create(model="", prompt="Rain?\n" + ("<think>\n" if opened else ""), **fields)
    expected = ReasoningParser("inside" if opened else "before").parse(raw.choices[0].text)
    blocks = [] if expected.reasoning is None else [("thinking", expected.reasoning)]
    blocks.append(("text", expected.content or ""))
    with claude(reasoning_server) as c:
        whole = c.messages.create(model="", messages=USER, thinking=thinking, **fields)
        with c.messages.stream(model="", messages=USER, thinking=thinking, **fields) as stream:
            streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content] == blocks
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == raw.usage.prompt_tokens


# ---- without a server -----------------------------------------------------------------------------

def test_a_body_becomes_the_chat_request_of_the_same_conversation():
    body = validated(MessagesRequest, {
        "max_tokens": 5, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "Rain?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"}, {"type": "text", "text": "Let me."},
                {"type": "tool_use", "id": "toolu_1", "name": "rain", "input": {"c": "Oslo"}},
                {"type": "redacted_thinking", "data": "xx"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "wet"}]}, {"type": "text", "text": "So?"}]}],
        "tools": [RAIN], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}, "stop_sequences": ["\n\n"], "top_k": 4,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    body.refuse_unsupported()
    chat = body.chat()
    assert chat.conversation() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rain?"},
        {"role": "assistant", "content": "Let me.", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "rain", "arguments": {"c": "Oslo"}}}]},
        {"role": "tool", "content": "wet", "tool_call_id": "toolu_1", "name": "rain"},
        {"role": "user", "content": "So?"}]
    assert [t.model_dump(exclude_unset=True) for t in chat.tools] == [{"type": "function", "function": {
        "name": "rain", "description": RAIN["description"], "parameters": RAIN["input_schema"]}}]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.chat_template_kwargs) == \
        ("required", False, {"enable_thinking": False})
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.temperature) == (5, ["\n\n"], 4, None)
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


def test_an_agent_turn_renders_as_the_same_chat_conversation_does():
    """Through a template in Qwen3's format: the reasoning of the turn after the last user message, the call and
    its result are written as the OpenAI client's equivalent conversation writes them."""
    template = ChatTemplate((Path(__file__).parents[1] / "runtime" / "chat_templates" / "qwen3.jinja").read_text())
    messages = validated(MessagesRequest, {"max_tokens": 5, "tools": [RAIN], "thinking": {"type": "disabled"},
                                           "messages": [*USER, {"role": "assistant", "content": [
                                               {"type": "thinking", "thinking": "Look it up."},
                                               {"type": "tool_use", "id": "t1", "name": "rain", "input": {"c": "Oslo"}}]},
                                               {"role": "user", "content": [
                                                   {"type": "tool_result", "tool_use_id": "t1", "content": "wet"}]}]})
    chat = validated(ChatCompletionRequest, {
        "tools": [{"type": "function", "function": {"name": "rain", "description": RAIN["description"],
                                                    "parameters": RAIN["input_schema"]}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "messages": [*USER, {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "rain", "arguments": '{"c": "Oslo"}'}}]},
                     {"role": "tool", "tool_call_id": "t1", "name": "rain", "content": "wet"}]})

    def rendered(body: ChatCompletionRequest) -> str:
        return template.render(body.conversation(), tools=body.tool_use(template.source).tools,
                               **body.chat_template_kwargs)

    text = rendered(messages.chat())
    assert text == rendered(chat)
    assert '<think>\nLook it up.\n</think>\n\n<tool_call>\n{"name": "rain", "arguments": {"c": "Oslo"}}' in text
    assert "<tool_response>\nwet\n</tool_response>" in text and text.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "id": "b"}]}]},
     "messages[0].content[0].id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [*USER, {"role": "assistant", "content": "The sky "}]}, "messages[1].content"),
    ({"messages": [*USER, {"role": "assistant", "content": []}]}, "messages[1].content"),
    ({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "I"}, {"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[1].content[1]"),
    ({"messages": [*USER, {"role": "assistant", "content": "I"}], "thinking": {"type": "enabled", "budget_tokens": 9}},
     "thinking"),
    ({"messages": [*USER, {"role": "assistant", "content": "{"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
    ({"messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": USER, "tools": [RAIN], "tool_choice": {"type": "tool", "name": "dry"}}, "tool_choice.name"),
    ({"messages": USER, "tools": [RAIN], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": USER, "tools": [RAIN, RAIN]}, "tools[1].name"),
    ({"messages": USER, "tools": [{**RAIN, "name": "no spaces"}]}, "tools[0].name"),
    ({"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": USER, "output_config": {"effort": "low"}}, "output_config.effort"),
])
def test_what_a_body_cannot_ask_is_refused_naming_the_field(body, field):
    with pytest.raises(InvalidRequest) as e:
        validated(MessagesRequest, {"max_tokens": 4, **body}).refuse_unsupported()
    assert e.value.field == field, e.value


CALL = '<tool_call>\n{"name": "rain", "arguments": {"c": "Oslo"}}\n</tool_call>'


class Decoded:
    """A tokenizer whose decoding of any ids is `text`: an output's whole text, its stop string included."""

    def __init__(self, text: str):
        self.text = text

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.text


@pytest.mark.parametrize("text, reader, finish, decoded, stop_reason", [
    ("Hello there", None, FinishReason.EOS, "", "end_turn"),
    ("", None, FinishReason.EOS, "", "end_turn"),
    ("Hello", None, FinishReason.STOP, "Hello\n\nmore", "stop_sequence"),
    ("Hello", None, FinishReason.STOP, "Hello", "end_turn"),  # a stop token, not a string
    ("<think>Mm, rain.</think>\n\nIt is wet.", OutputReader(None, ReasoningParser()), FinishReason.LENGTH, "",
     "max_tokens"),
    ("<think>Mm.</think>" + CALL, OutputReader(ToolCallParser("hermes", {"rain"}), ReasoningParser()),
     FinishReason.EOS, "", "tool_use"),
])
@pytest.mark.parametrize("step", [1, 3, 100])
def test_the_stream_accumulates_to_the_whole_message(text, reader, finish, decoded, stop_reason, step):
    def builder() -> MessageBuilder:
        accepted = AcceptedRequest(GenerationRequest("r", [1, 2, 3]), "r", "", False)
        return MessageBuilder("m", accepted, reader, Decoded(decoded), ["zz", "\n\n"])

    parts = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    events = [TokenEvent("r", 0, 7, None, None, part, finish if i == len(parts) - 1 else None)
              for i, part in enumerate(parts)]
    whole = builder()
    whole.add(0, events)
    whole.timings_of = lambda: [Timing(0.0, cached_tokens=1)]
    expected = anthropic.types.Message.model_validate(whole.response())
    assert expected.stop_reason == stop_reason
    assert expected.stop_sequence == ("\n\n" if stop_reason == "stop_sequence" else None)
    streamed = builder()
    chunks = streamed.stream_head() + [chunk for e in events for chunk in streamed.chunks(0, [e])]
    streamed.timings_of = lambda: [Timing(0.0, cached_tokens=1)]
    snapshot, buffers = None, {}
    for chunk in chunks + streamed.stream_tail():
        name, data = chunk.decode().removesuffix("\n\n").split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert name == f"event: {body['type']}"
        snapshot = accumulate_event(event=body, current_snapshot=snapshot, json_bufs=buffers)
    assert all(b.id.startswith("toolu_") for b in [*expected.content, *snapshot.content] if b.type == "tool_use")
    without_ids = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in expected.content]
    assert [{k: v for k, v in b.model_dump().items() if k != "id"} for b in snapshot.content] == without_ids
    assert (snapshot.stop_reason, snapshot.stop_sequence, snapshot.usage) == \
        (expected.stop_reason, expected.stop_sequence, expected.usage)
    assert expected.usage.model_dump(exclude_none=True) == {"input_tokens": 2, "cache_read_input_tokens": 1,
                                                            "output_tokens": len(events)}
