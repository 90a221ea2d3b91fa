"""Reasoning sections (`<think>…</think>`) read apart from the answer: the parser whole and streamed (the pieces
add up to the whole however the output is cut), calls read from the answer alone, the chat response's
`reasoning_content` whole and streamed, when a bundle's output is read for reasoning, and
`chat_template_kwargs` reaching the template through the HTTP front."""

from __future__ import annotations

import json

import pytest

from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.fronts.chat_output import OutputReader, output_reader
from service.fronts.http.openai_responses import ChatBuilder
from service.fronts.reasoning import ReasoningParser, opens_reasoning, template_reasons
from service.fronts.tool_calls import ParsedMessage, ToolCallParser, ToolUse
from service.fronts.validation import AcceptedRequest

# (output, the prompt left the model inside the section, reasoning, content)
OUTPUTS = [
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", False, "Two and two.", "It is 4."),
    ("  <think>a  b </think>c", False, "a  b", "c"),
    ("<think>\n\n</think>\n\nJust the answer.", False, None, "Just the answer."),
    ("No section, <think>here</think> is text.", False, None, "No section, <think>here</think> is text."),
    ("<thin", False, None, "<thin"),
    ("<think>cut off by max_tokens \n", False, "cut off by max_tokens", None),
    ("Opened by the prompt.\n</think>\n\nThe answer.", True, "Opened by the prompt.", "The answer."),
    ("\nnever closed </thi", True, "never closed </thi", None),
    ("</think>straight to it", True, None, "straight to it"),
    ("", True, None, None),
    ("", False, None, None),
    ("  \n", False, None, "  \n"),
]


def pieces(parser, output: str, cuts: list[int]) -> ParsedMessage:
    stream, message, at = parser.stream(), ParsedMessage(), 0
    for cut in [*cuts, len(output)]:
        message.extend(stream.feed(output[at:cut]))
        at = cut
    message.extend(stream.finish())
    return message


@pytest.mark.parametrize("output,inside,reasoning,content", OUTPUTS)
def test_the_reasoning_is_read_apart_from_the_answer(output, inside, reasoning, content):
    message = ReasoningParser(inside).parse(output)
    assert (message.reasoning, message.content, message.calls) == (reasoning, content, [])


@pytest.mark.parametrize("output,inside,reasoning,content", OUTPUTS)
def test_the_streamed_pieces_add_up_to_the_whole_at_every_split_point(output, inside, reasoning, content):
    parser = ReasoningParser(inside)
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
    assert output_reader("{{ x }}", "prompt", None, False) is None
    reader = output_reader(qwen3, "<|im_start|>assistant\n", None, False)
    assert reader.tools is None and reader.reasoning.inside is False
    assert output_reader("<think>", "x<think>\n", None, False).reasoning.inside
    assert output_reader("<think>", "x<think>\n", None, True) is None  # constrained: all answer
    tools = ToolUse.of([{"type": "function", "function": {"name": "f"}}], "<tool_call>", required=True)
    constrained = output_reader("<think>", "x<think>\n", tools, True)
    assert constrained.reasoning is None and constrained.tools is tools.parser


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
    assert choice["message"]["reasoning_content"] == "Weather needed." and choice["message"]["content"] == "Checking."
    assert choice["finish_reason"] == ("tool_calls" if tools else "stop")
    assert len(choice["message"].get("tool_calls", [])) == int(tools)
    streamed = builder(reader)
    chunks = [json.loads(c.removeprefix(b"data: ")) for c in streamed.stream_head() + streamed.chunks(0, events(output))]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Weather needed."
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
    from tests.fronts.server_harness import ServerThread, free_port, settings, with_chat_template

    bundle = with_chat_template(engine_bundle, tmp_path_factory.mktemp("reasoning"), SERVER_TEMPLATE)
    with ServerThread(settings(bundle, http_port=free_port())) as srv:
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
    expected = ReasoningParser(inside=True).parse(text)
    assert chat["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    assert (message["reasoning_content"], message["content"]) == (expected.reasoning, expected.content)
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


@pytest.fixture(scope="module")
def qwen3_server(engine_bundle, tmp_path_factory):
    """The engine bundle with the test template in Qwen3's prompt format."""
    from pathlib import Path

    from tests.fronts.server_harness import ServerThread, free_port, settings, with_chat_template

    template = (Path(__file__).parents[1] / "runtime" / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    bundle = with_chat_template(engine_bundle, tmp_path_factory.mktemp("qwen3"), template)
    with ServerThread(settings(bundle, http_port=free_port())) as srv:
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
    expected = ReasoningParser(inside=False).parse(raw["choices"][0]["text"])
    message = chat["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (expected.reasoning, expected.content)
