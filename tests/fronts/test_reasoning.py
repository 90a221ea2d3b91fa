"""Reasoning sections (`<think>…</think>`) read apart from the answer: the parser whole and streamed (the pieces
add up to the whole however the output is cut), calls read from the answer alone, the chat response's
`reasoning_content` and `reasoning` whole and streamed, when a bundle's output is read for reasoning,
`chat_template_kwargs` reaching the template through the HTTP front (Qwen3's enable_thinking=false: all
answer), and structured output constrained after the section, never inside it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.fronts.chat_output import OutputReader, output_reader
from service.fronts.http.openai_responses import ChatBuilder
from service.fronts.reasoning import ReasoningParser, opens_reasoning, output_start, template_reasons
from service.fronts.tool_calls import ParsedMessage, ToolCallParser, ToolUse
from service.fronts.validation import AcceptedRequest

# (output, where it starts: before, inside or after a section (`output_start`), reasoning, content)
OUTPUTS = [
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", "before", "Two and two.", "It is 4."),
    ("  <think>a  b </think>c", "before", "a  b", "c"),
    ("<think>\n\n</think>\n\nJust the answer.", "before", None, "Just the answer."),
    ("No section, <think>here</think> is text.", "before", None, "No section, <think>here</think> is text."),
    ("<thin", "before", None, "<thin"),
    ("<think>cut off by max_tokens \n", "before", "cut off by max_tokens", None),
    ("Opened by the prompt.\n</think>\n\nThe answer.", "inside", "Opened by the prompt.", "The answer."),
    ("\nnever closed </thi", "inside", "never closed </thi", None),
    ("</think>straight to it", "inside", None, "straight to it"),
    ("", "inside", None, None),
    ("", "before", None, None),
    ("  \n", "before", None, "  \n"),
    ("<think>closed by the prompt</think> all answer", "after", None, "<think>closed by the prompt</think> all answer"),
    ("\nAnswer.", "after", None, "\nAnswer."),
]


def pieces(parser, output: str, cuts: list[int]) -> ParsedMessage:
    stream, message, at = parser.stream(), ParsedMessage(), 0
    for cut in [*cuts, len(output)]:
        message.extend(stream.feed(output[at:cut]))
        at = cut
    message.extend(stream.finish())
    return message


@pytest.mark.parametrize("output,start,reasoning,content", OUTPUTS)
def test_the_reasoning_is_read_apart_from_the_answer(output, start, reasoning, content):
    message = ReasoningParser(start).parse(output)
    assert (message.reasoning, message.content, message.calls) == (reasoning, content, [])


@pytest.mark.parametrize("output,start,reasoning,content", OUTPUTS)
def test_the_streamed_pieces_add_up_to_the_whole_at_every_split_point(output, start, reasoning, content):
    parser = ReasoningParser(start)
    for cut in range(len(output) + 1):
        message = pieces(parser, output, [cut])
        assert (message.reasoning, message.content) == (reasoning, content), cut
    one_by_one = pieces(parser, output, list(range(1, len(output))))
    assert (one_by_one.reasoning, one_by_one.content) == (reasoning, content)


def test_reasoning_streams_as_it_comes_but_for_what_may_close_it():
    stream = ReasoningParser().stream()
    assert stream.feed("<thi").reasoning is None
    assert stream.feed("nk>\nLet me ").reasoning == "Let me"  # trailing whitespace held: the section may end
    assert stream.feed("see </th").reasoning == " see"
    piece = stream.feed("ink>\n\nYes")
    assert (piece.reasoning, piece.content) == (None, "Yes")
    assert stream.feed(", sure.").content == ", sure."


WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("cut", [0, 5, 12, 30, 47, 60])
def test_calls_are_read_from_the_answer_alone(cut):
    output = f"<think>I could write {WEATHER_CALL} here.</think>\n\nLet me look.\n{WEATHER_CALL}"
    reader = OutputReader(ToolCallParser("hermes", {"get_weather"}), ReasoningParser())
    for message in (reader.parse(output), pieces(reader, output, [cut])):
        assert message.reasoning == f"I could write {WEATHER_CALL} here."
        assert message.content == "Let me look.\n"
        assert [(c.name, json.loads(c.arguments)) for c in message.calls] == [("get_weather", {"city": "Paris"})]


def test_a_bundles_output_is_read_for_reasoning_when_its_template_mentions_think():
    qwen3 = "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    assert template_reasons(qwen3) and not template_reasons("{{ messages[0].content }}")
    assert template_reasons("{{ m.content.split('</think>') | last }}")  # as DeepSeek-R1's first templates do
    assert opens_reasoning("<｜Assistant｜><think>\n") and not opens_reasoning("assistant\n<think>\n\n</think>\n\n")
    assert output_start("{{ x }}", "prompt") is None and output_reader(None, None) is None
    assert output_start(qwen3, "<|im_start|>assistant\n") == "before"
    assert output_start(qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "after"  # enable_thinking=false
    assert output_start("<think>", "x<think>\n") == "inside"
    reader = output_reader("before", None)
    assert reader.tools is None and reader.reasoning.start == "before"
    tools = ToolUse.of([{"type": "function", "function": {"name": "f"}}], "<tool_call>", required=True)
    constrained = output_reader("inside", tools)  # a constraint applies after the section: it is still read
    assert constrained.reasoning.start == "inside" and constrained.tools is tools.parser


# ---- the chat response -------------------------------------------------------------------------

def builder(reader: OutputReader | None) -> ChatBuilder:
    accepted = AcceptedRequest(GenerationRequest("r", [1, 2, 3]), "r", "", False)
    return ChatBuilder("m", [accepted], None, reader=reader)


def events(text: str, step: int = 3) -> list[TokenEvent]:
    parts = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    return [TokenEvent("r", 0, 7, None, None, part, FinishReason.EOS if i == len(parts) - 1 else None)
            for i, part in enumerate(parts)]


@pytest.mark.parametrize("tools", [False, True])
def test_the_message_carries_reasoning_content_whole_and_streamed(tools):
    output = f"<think>\nWeather needed.\n</think>\n\nChecking.{WEATHER_CALL if tools else ''}"
    reader = OutputReader(ToolCallParser("hermes", {"get_weather"}) if tools else None, ReasoningParser())
    whole = builder(reader)
    whole.add(0, events(output))
    choice = whole.response()["choices"][0]
    assert choice["message"]["reasoning_content"] == choice["message"]["reasoning"] == "Weather needed."
    assert choice["message"]["content"] == "Checking."
    assert choice["finish_reason"] == ("tool_calls" if tools else "stop")
    assert len(choice["message"].get("tool_calls", [])) == int(tools)
    streamed = builder(reader)
    chunks = [json.loads(c.removeprefix(b"data: ")) for c in streamed.stream_head() + streamed.chunks(0, events(output))]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Weather needed."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert sum(len(d.get("tool_calls", [])) for d in deltas) == int(tools)
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_without_a_reasoning_template_the_message_has_no_reasoning_content():
    b = builder(None)
    b.add(0, events("<think>x</think>y"))
    assert b.response()["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}


# ---- through the HTTP front ----------------------------------------------------------------------
#
# A template whose generation prompt opens the section, as DeepSeek-R1's does, unless enable_thinking is false
# (Qwen3's switch): the tiny model's arbitrary text is then reasoning up to any `</think>` it writes.

SERVER_TEMPLATE = ("{% for m in messages %}{{ m.content or '' }}\n{% endfor %}"
                   "{% if add_generation_prompt and enable_thinking is not false %}<think>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Rain?"}]


@pytest.fixture(scope="module")
def reasoning_server(engine_bundle, tmp_path_factory):
    from tests.fronts.server_harness import templated_server

    with templated_server(engine_bundle, tmp_path_factory.mktemp("reasoning"), SERVER_TEMPLATE) as srv:
        yield srv


def post(srv, path: str, body: dict):
    httpx2 = pytest.importorskip("httpx2")
    with httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        return h.post(path, content=json.dumps(body))


def test_a_served_answer_is_split_as_the_parser_splits_the_same_text(reasoning_server):
    fields = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    raw = post(reasoning_server, "/v1/completions", {"prompt": "Rain?\n<think>\n", **fields}).json()
    text = raw["choices"][0]["text"]
    chat = post(reasoning_server, "/v1/chat/completions", {"messages": MESSAGES, **fields}).json()
    message = chat["choices"][0]["message"]
    expected = ReasoningParser("inside").parse(text)
    assert chat["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    assert (message["reasoning_content"], message["content"]) == (expected.reasoning, expected.content)
    assert message["reasoning"] == message["reasoning_content"]
    assert message["reasoning_content"] or message["content"]
    stream = post(reasoning_server, "/v1/chat/completions", {"messages": MESSAGES, "stream": True, **fields})
    deltas = [json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
              for line in stream.text.splitlines() if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (expected.reasoning or "")
    assert "".join(d.get("content") or "" for d in deltas) == (expected.content or "")


def test_chat_template_kwargs_reach_the_template(reasoning_server):
    fields = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    thinking = post(reasoning_server, "/v1/chat/completions", fields).json()
    off = post(reasoning_server, "/v1/chat/completions",
               {**fields, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["usage"]["prompt_tokens"] < thinking["usage"]["prompt_tokens"]
    raw = post(reasoning_server, "/v1/completions", {"prompt": "Rain?\n", **{k: v for k, v in fields.items()
                                                                               if k != "messages"}}).json()
    assert off["choices"][0]["message"]["content"] == (raw["choices"][0]["text"] or None)  # not opened: all answer
    assert off["choices"][0]["message"]["reasoning_content"] is None
    refused = post(reasoning_server, "/v1/chat/completions", {**fields, "chat_template_kwargs": {"tools": []}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.tools"


def test_reasoning_effort_is_the_templates_switch(reasoning_server):
    """OpenAI's `reasoning_effort`: "none" is enable_thinking false, any other effort true; sent with an
    enable_thinking that says otherwise, it is refused."""
    fields = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for effort, thinking in (("none", False), ("low", True), ("high", True)):
        by_effort = post(reasoning_server, "/v1/chat/completions", {**fields, "reasoning_effort": effort}).json()
        by_switch = post(reasoning_server, "/v1/chat/completions",
                         {**fields, "chat_template_kwargs": {"enable_thinking": thinking}}).json()
        assert by_effort["usage"] == by_switch["usage"]
        assert by_effort["choices"][0]["message"] == by_switch["choices"][0]["message"]
    assert post(reasoning_server, "/v1/chat/completions", {**fields, "reasoning_effort": "high"}).json()["usage"] != \
        post(reasoning_server, "/v1/chat/completions", {**fields, "reasoning_effort": "none"}).json()["usage"]
    refused = post(reasoning_server, "/v1/chat/completions", {**fields, "reasoning_effort": "none",
                                                                "chat_template_kwargs": {"enable_thinking": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"


@pytest.fixture(scope="module")
def qwen3_server(engine_bundle, tmp_path_factory):
    """The engine bundle with the test template in Qwen3's prompt format."""
    from pathlib import Path

    from tests.fronts.server_harness import templated_server

    template = (Path(__file__).parents[1] / "runtime" / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    with templated_server(engine_bundle, tmp_path_factory.mktemp("qwen3"), template) as srv:
        yield srv


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3s_template_serves_its_prompt_and_reads_its_output(qwen3_server, thinking):
    fields = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompt = "<|im_start|>user\nRain?<|im_end|>\n<|im_start|>assistant\n" + ("" if thinking else
                                                                          "<think>\n\n</think>\n\n")
    raw = post(qwen3_server, "/v1/completions", {"prompt": prompt, **fields}).json()
    kwargs = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    chat = post(qwen3_server, "/v1/chat/completions", {"messages": MESSAGES, **kwargs, **fields}).json()
    assert chat["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    text = raw["choices"][0]["text"]
    expected = ReasoningParser("before").parse(text) if thinking else ReasoningParser("after").parse(text)
    message = chat["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (expected.reasoning, expected.content)
    if not thinking:  # the template closed an empty section in the prompt: the output is all answer
        assert (message["reasoning_content"], message["content"]) == (None, text or None)


# ---- structured output after the reasoning section --------------------------------------------------------
#
# The tiny model's text is arbitrary: `max_reasoning_chars` makes the grammar close its section, then the answer
# is what the constraint allows. Greedy, so the stream is the whole response cut into pieces.

COLOUR = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"],
          "additionalProperties": False}
BOUND = 16


def streamed_message(srv, body: dict) -> tuple[dict, str | None]:
    """The message a stream's deltas add up to, and its last finish_reason."""
    r = post(srv, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    text = {key: "".join(d.get(key) or "" for d in deltas) or None for key in ("reasoning_content", "content")}
    return text, chunks[-1]["choices"][0]["finish_reason"]


OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# (server, template variables, where the output starts): SERVER_TEMPLATE opens the section unless thinking is
# off, when the prompt is before any; Qwen3's with thinking off closes an empty one in the prompt
STARTS = [("reasoning_server", {}, "inside"), ("reasoning_server", OFF, "before"), ("qwen3_server", OFF, "after")]


@pytest.mark.parametrize("server, kwargs, start", STARTS, ids=[s for _, _, s in STARTS])
def test_a_json_schema_constrains_the_answer_after_the_reasoning(request, server, kwargs, start):
    """With the section opened by the prompt the model must write it, may write one when the prompt is before
    any, and writes none after a closed one; the content validates each way, the reasoning is apart."""
    srv = request.getfixturevalue(server)
    body = {"messages": MESSAGES, "max_tokens": 56, "temperature": 0, "max_reasoning_chars": BOUND,
            "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}},
            **kwargs}
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    whole = r.json()
    choice = whole["choices"][0]
    message = choice["message"]
    jsonschema.validate(json.loads(message["content"]), COLOUR)
    assert choice["finish_reason"] == "stop" and message["reasoning"] == message["reasoning_content"]
    assert len(message["reasoning_content"] or "") <= BOUND
    answer_tokens = post(srv, "/tokenize", {"prompt": message["content"]}).json()["count"]
    if start == "inside":  # the section and its `</think>` were written before the answer
        assert whole["usage"]["completion_tokens"] > answer_tokens
    if start == "after":
        assert message["reasoning_content"] is None
    streamed, finish_reason = streamed_message(srv, body)
    assert streamed == {"reasoning_content": message["reasoning_content"], "content": message["content"]}
    assert finish_reason == "stop"


def test_an_unconstrained_section_is_bounded_by_max_reasoning_chars(reasoning_server):
    body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    free = post(reasoning_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    bounded = post(reasoning_server, "/v1/chat/completions", {**body, "max_reasoning_chars": 4}).json()
    message = bounded["choices"][0]["message"]
    assert len(message["reasoning_content"] or "") <= 4
    assert len(free["reasoning_content"] or "") > 4  # the tiny model does not close its section on its own
    for bad in (0, 100_001):
        refused = post(reasoning_server, "/v1/chat/completions", {**body, "max_reasoning_chars": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_reasoning_chars"


@pytest.mark.parametrize("thinking", [True, False])
def test_a_required_tool_call_comes_after_the_reasoning(reasoning_server, thinking):
    """Inside the section the prompt opened, or before any (the test template reads no tools: Qwen3's tool prompt
    alone is longer than the tiny model's context)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    body = {"messages": MESSAGES, "max_tokens": 110, "temperature": 0, "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": False, "max_reasoning_chars": 4,  # the call itself takes most of the context
            **({} if thinking else OFF)}
    r = post(reasoning_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
    assert len(choice["message"]["reasoning_content"] or "") <= 4
