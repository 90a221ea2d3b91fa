"""The tool-call formats of today's families: the test template in each family's prompt format
(tests/runtime/chat_templates/) picks its format; Phi-4-mini's `<|tool_call|>[...]<|/tool_call|>` and the pythonic
`[f(a=1)]` (Gemma 3) are read whole and streamed (the pieces add up to the whole at every split point); and the
grammar of a required or named call in each format compiles and admits exactly the calls the parser reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.fronts.tool_calls import ParsedMessage, ToolCallParser, call_grammar, template_format
from tests.fronts.test_tool_calls import ARGS, LLAMA31, NAMES, TOOLS, calls_of, ll_tokenizer, matches  # noqa: F401

TEMPLATES = Path(__file__).parents[1] / "runtime" / "chat_templates"


@pytest.mark.parametrize("name,fmt", [("qwen3", "hermes"), ("smollm3", "hermes"), ("phi4_mini", "phi4_json"),
                                      ("gemma3_tools_pythonic", "pythonic"), ("llama3.2", "llama3_json"),
                                      ("gemma3", "hermes")])
def test_each_familys_template_picks_its_format(name, fmt):
    assert template_format((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")) == fmt
    assert template_format(LLAMA31) == "llama3_json"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}'
TIME = '{"name": "local_time", "arguments": {}}'
OUTPUTS = [  # (format, output, content, calls)
    ("phi4_json", f"<|tool_call|>[{WEATHER}]<|/tool_call|>", None, [("get_weather", ARGS)]),
    ("phi4_json", f" <|tool_call|>[{WEATHER}, {TIME}]<|/tool_call|>\n", None, [("get_weather", ARGS), ("local_time", {})]),
    ("phi4_json", f"<|tool_call|>{WEATHER}<|/tool_call|><|tool_call|>{TIME}<|/tool_call|>", None,
     [("get_weather", ARGS), ("local_time", {})]),
    ("phi4_json", f"[{WEATHER}]", None, [("get_weather", ARGS)]),  # the tags are special tokens, left out of the text
    ("phi4_json", f"<|tool_call|>[{WEATHER}]", f"<|tool_call|>[{WEATHER}]", []),  # cut off before its close
    ("phi4_json", '<|tool_call|>[{"name": "launch", "arguments": {}}]<|/tool_call|>',
     '<|tool_call|>[{"name": "launch", "arguments": {}}]<|/tool_call|>', []),
    ("phi4_json", f"<|tool_call|>[{WEATHER}]<|/tool_call|> and text", f"<|tool_call|>[{WEATHER}]<|/tool_call|> and text", []),
    ("phi4_json", "It is sunny [really].", "It is sunny [really].", []),
    ("pythonic", '[get_weather(city="Zürich", unit="C")]', None, [("get_weather", ARGS)]),
    ("pythonic", "[get_weather(city='Zürich', unit='C'), local_time()]", None, [("get_weather", ARGS), ("local_time", {})]),
    ("pythonic", '[local_time(tz=null, dst=true, at=[1, 2.5], where={"a": "b"})]', None,
     [("local_time", {"tz": None, "dst": True, "at": [1, 2.5], "where": {"a": "b"}})]),
    ("pythonic", "[local_time(tz=None, dst=True)]", None, [("local_time", {"tz": None, "dst": True})]),
    ("pythonic", '[launch(city="Paris")]', '[launch(city="Paris")]', []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: not a call
    ("pythonic", '[get_weather(city=x)]', '[get_weather(city=x)]', []),  # a variable: not a literal
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "Sunny, 21 [C].", "Sunny, 21 [C].", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None,
     [("get_weather", ARGS), ("local_time", {})]),  # Qwen3 writes Qwen2.5's blocks
]


@pytest.mark.parametrize("fmt,output,content,calls", OUTPUTS)
def test_the_output_is_read_whole_and_streamed_at_every_split_point(fmt, output, content, calls):
    parser = ToolCallParser(fmt, NAMES)
    message = parser.parse(output)
    assert message.content == content and calls_of(message) == calls
    for cut in range(len(output) + 1):
        stream, streamed = parser.stream(), ParsedMessage()
        streamed.extend(stream.feed(output[:cut]))
        streamed.extend(stream.feed(output[cut:]))
        streamed.extend(stream.finish())
        assert streamed.content == content and calls_of(streamed) == calls, cut


def test_text_streams_at_once_unless_it_begins_as_calls_do():
    assert ToolCallParser("pythonic", NAMES).stream().feed("Sunny [C]").content == "Sunny [C]"
    assert ToolCallParser("phi4_json", NAMES).stream().feed("Sunny").content == "Sunny"
    held = ToolCallParser("phi4_json", NAMES).stream()
    assert held.feed("<|tool_").content is None and held.feed("call|>[").content is None


@pytest.mark.parametrize("fmt", ["phi4_json", "pythonic"])
@pytest.mark.parametrize("name", [None, "get_weather", "local_time"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_grammar_compiles_and_matches_exactly_the_calls_the_parser_reads(ll_tokenizer, fmt, name, parallel):  # noqa: F811
    import llguidance

    grammar = call_grammar(TOOLS, fmt, parallel, name)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""

    def written(calls):  # as the grammar lays them out: json.dumps's separators
        if fmt == "phi4_json":
            bodies = [json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls]
            return "<|tool_call|>[" + ", ".join(bodies) + "]<|/tool_call|>"
        bodies = [n + "(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in a.items()) + ")"
                  for n, a in calls]
        return "[" + ", ".join(bodies) + "]"

    several = parallel and name is None
    for calls in ([("get_weather", ARGS)], [("get_weather", {"city": "Zürich"})], [("local_time", {})],
                  [("local_time", {}), ("get_weather", ARGS)]):
        text = written(calls)
        allowed = all(name in (None, n) for n, _ in calls) and (len(calls) == 1 or several)
        assert matches(ll_tokenizer, grammar, text) == allowed, text
        if allowed:
            assert calls_of(ToolCallParser(fmt, NAMES).parse(text)) == calls
    assert not matches(ll_tokenizer, grammar, written([("get_weather", {"unit": "C"})]))  # city is required
    assert not matches(ll_tokenizer, grammar, written([("get_weather", {"unit": "C", "city": "Zürich"})]))  # order
    assert not matches(ll_tokenizer, grammar, written([("local_time", {"x": 1})]))  # not a declared parameter
    assert not matches(ll_tokenizer, grammar, written([("launch", {})]))
    assert not matches(ll_tokenizer, grammar, "It is sunny.")


# ---- through the HTTP front, with the engine applying the grammar ---------------------------------
#
# Compact templates (the engine bundle's context is 128 tokens) that name each format as the families'
# templates do; a random-weight model writes calls only when the grammar makes it.

SERVER_TEMPLATES = {"phi4_json": "{# <|tool_call|> #}", "pythonic": "{# [func_name(param=value)] #}"}
RAIN = {"type": "function", "function": {"name": "rain", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}, "required": ["c"]}}}
DRY = {"type": "function", "function": {"name": "dry"}}


@pytest.fixture(scope="module", params=list(SERVER_TEMPLATES))
def format_server(request, engine_bundle, tmp_path_factory):
    from tests.fronts.server_harness import templated_server

    template = SERVER_TEMPLATES[request.param] + "{% for m in messages %}{{ m.content or '' }}\n{% endfor %}"
    with templated_server(engine_bundle, tmp_path_factory.mktemp(request.param), template) as srv:
        yield srv


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "rain"}}])
def test_enforced_calls_in_each_format_are_read_whole_and_streamed(format_server, choice):
    openai = pytest.importorskip("openai")
    fields = dict(model="", messages=[{"role": "user", "content": "Rain?"}], tools=[RAIN, DRY], tool_choice=choice,
                  parallel_tool_calls=False, max_tokens=100, temperature=0.8)
    names = {"rain"} if isinstance(choice, dict) else {"rain", "dry"}
    with openai.OpenAI(base_url=format_server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
        for seed in range(2):
            whole = api.chat.completions.create(seed=seed, **fields).choices[0]
            assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole
            call = whole.message.tool_calls[0]
            assert call.function.name in names and isinstance(json.loads(call.function.arguments), dict)
            with api.chat.completions.stream(seed=seed, **fields) as stream:
                streamed = stream.get_final_completion().choices[0].message.tool_calls
            assert [(c.function.name, c.function.arguments) for c in streamed] == \
                [(call.function.name, call.function.arguments)]
