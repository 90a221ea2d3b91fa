"""Tool calls on /v1/chat/completions: the tools rendered by the model's template as transformers'
`apply_chat_template(..., tools=...)` renders them (a Qwen2.5-style and a Llama 3.1-style template); the
model's output read into OpenAI's `tool_calls`, whole or streamed (the openai SDK's accumulation of the
stream gives the whole response's calls); the grammar for `tool_choice` "required" or a named tool;
and the 400s of malformed tools.

`test_enforced_*` need the engine to apply the request's grammar constraint: a random-weight model writes
tool-call syntax only when made to.
"""

from __future__ import annotations

import json
import random

import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.fronts.chat_output import OutputReader
from service.fronts.http.openai_responses import ChatBuilder
from service.fronts.http.openai_schema import ChatCompletionRequest
from service.fronts.http.request_body import validated
from service.fronts.tool_calls import ParsedMessage, ToolCallParser, ToolUse, call_grammar, template_format
from service.fronts.validation import AcceptedRequest
from service.runtime.chat_template import ChatTemplate

HERMES = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31 = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "local_time", "description": "Local time {at} \"a\" place"}}
TOOLS = [WEATHER, TIME]
NAMES = {"get_weather", "local_time"}
ARGS = {"city": "Zürich", "unit": "C"}

# a conversation with an earlier call and its result, as an OpenAI client sends it ...
OPENAI_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "And now?"},
]
# ... and as transformers' documentation passes it to apply_chat_template: the arguments a dict
HF_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "And now?"},
]


def request(**fields) -> ChatCompletionRequest:
    body = validated(ChatCompletionRequest, {"messages": OPENAI_MESSAGES, **fields})
    body.refuse_unsupported()
    return body


# ---- rendering -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source,fmt", [(HERMES, "hermes"), (LLAMA31, "llama3_json")])
def test_tools_render_as_transformers_apply_chat_template_renders_them(tmp_path, source, fmt):
    transformers = pytest.importorskip("transformers")
    from tests.runtime.test_tokenizers import byte_level

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level(tmp_path), bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>")
    fast.chat_template = source
    fast.save_pretrained(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    template = ChatTemplate.from_bundle(tmp_path)
    body = request(tools=TOOLS)
    use = body.tool_use(template.source)
    assert use.parser.format == template_format(source) == fmt
    ours = template.render(body.conversation(), add_generation_prompt=True, tools=use.tools)
    theirs = auto.apply_chat_template(HF_MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert "get_weather" in ours and "Zürich" in ours
    without = template.render(body.conversation(), add_generation_prompt=True)
    assert without == auto.apply_chat_template(HF_MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "local_time" not in without


def test_tool_choice_none_renders_no_tools_and_reads_no_calls():
    assert request(tools=TOOLS, tool_choice="none").tool_use(HERMES) is None
    assert request(tool_choice="none").tool_use(HERMES) is None  # accepted without tools, changes nothing
    assert request(tool_choice="auto").tool_use(HERMES) is None
    assert request(tools=[]).tool_use(HERMES) is None


def test_the_format_follows_the_template_and_falls_back_to_hermes():
    assert template_format("{{ '<tool_call>' }}") == "hermes"
    assert template_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert template_format("Environment: ipython") == "llama3_json"
    assert template_format("{{ message.content }}") == "hermes"


# ---- parsing -------------------------------------------------------------------------------------

def calls_of(message: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in message.calls]


HERMES_OUTPUTS = [  # (output, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n</tool_call>',
     None, [("get_weather", ARGS)]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "local_time", "arguments": {}}\n</tool_call>\n',
     "Let me look.\n", [("get_weather", ARGS), ("local_time", {})]),
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),  # an unknown tool stays text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),  # not JSON
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city"', '<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city"', []),  # cut off by max_tokens
    ('<tool_call>{"name": ["get_weather"]}</tool_call>', '<tool_call>{"name": ["get_weather"]}</tool_call>', []),
    ('<tool_call>{"name": "local_time", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "local_time", "arguments": "{}"}</tool_call>', []),
    ("No call: a <tool_ tag and a </tool_call> alone.", "No call: a <tool_ tag and a </tool_call> alone.", []),
    ("  ", "  ", []),
    ("", None, []),
]
LLAMA3_OUTPUTS = [
    ('{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "C"}}', None, [("get_weather", ARGS)]),
    ('<|python_tag|>{"name": "local_time", "arguments": {}}', None, [("local_time", {})]),
    (' {"name": "local_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Zürich", '
     '"unit": "C"}}', None, [("local_time", {}), ("get_weather", ARGS)]),
    ('{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),
    ('{"name": "local_time", "parameters": {}} and then', '{"name": "local_time", "parameters": {}} and then', []),
    ('{"name": "local_time", "parameters": ', '{"name": "local_time", "parameters": ', []),
    ("It is sunny {really}.", "It is sunny {really}.", []),
]
OUTPUTS = [("hermes", *case) for case in HERMES_OUTPUTS] + [("llama3_json", *case) for case in LLAMA3_OUTPUTS]


@pytest.mark.parametrize("fmt,output,content,calls", OUTPUTS)
def test_the_output_is_read_into_calls_and_content(fmt, output, content, calls):
    message = ToolCallParser(fmt, NAMES).parse(output)
    assert message.content == content and calls_of(message) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 and int(c.id[5:], 16) >= 0 for c in message.calls)
    assert len({c.id for c in message.calls}) == len(message.calls)


@pytest.mark.parametrize("fmt,output,content,calls", OUTPUTS)
def test_a_streamed_output_adds_up_to_the_whole_however_it_is_cut(fmt, output, content, calls):
    parser = ToolCallParser(fmt, NAMES)
    for seed in range(30):
        rng, stream, message, at = random.Random(seed), parser.stream(), ParsedMessage(), 0
        while at < len(output):
            step = rng.randint(1, 6)
            message.extend(stream.feed(output[at:at + step]))
            at += step
        message.extend(stream.finish())
        assert message.content == content and calls_of(message) == calls, seed


def test_text_streams_at_once_until_a_call_may_begin():
    stream = ToolCallParser("hermes", NAMES).stream()
    assert stream.feed("Sunny ").content == "Sunny "
    assert stream.feed("today. <tool").content == "today. "  # "<tool" may begin a call: held
    assert stream.feed('_call>\n{"name": "local_time", "arguments": {}}\n').content is None
    piece = stream.feed("</tool_call>")
    assert piece.content is None and calls_of(piece) == [("local_time", {})]
    llama = ToolCallParser("llama3_json", NAMES).stream()
    assert llama.feed("Sunny").content == "Sunny"
    held = ToolCallParser("llama3_json", NAMES).stream()
    assert held.feed(' {"name": "local_time", ').content is None
    assert calls_of(held.finish()) == []  # not a whole call: held text, sent at the end
    assert ToolCallParser("llama3_json", NAMES).parse(' {"name": "local_time", ').content == ' {"name": "local_time", '


# ---- responses, whole and streamed ---------------------------------------------------------------

def builder(fmt: str | None, n: int = 1) -> ChatBuilder:
    accepted = AcceptedRequest(GenerationRequest("r", [1, 2, 3], n=n), "r", "", False)
    return ChatBuilder("m", [accepted], None, reader=OutputReader(ToolCallParser(fmt, NAMES), None) if fmt else None)


def events(text: str, index: int = 0, finish: FinishReason = FinishReason.EOS, step: int = 3) -> list[TokenEvent]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    return [TokenEvent("r", index, 7, None, None, piece, finish if i == len(pieces) - 1 else None)
            for i, piece in enumerate(pieces)]


def accumulated(chunks):
    """The stream (SSE events, or the SDK's chunks) as the openai SDK accumulates it."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for chunk in chunks:
        if isinstance(chunk, bytes):
            chunk = ChatCompletionChunk.model_validate(json.loads(chunk.removeprefix(b"data: ")))
        state.handle_chunk(chunk)
    return state.current_completion_snapshot  # get_final_completion() refuses a "length" finish


@pytest.mark.parametrize("fmt,output,content,calls", OUTPUTS)
def test_the_sdk_accumulates_the_stream_into_the_whole_response(fmt, output, content, calls):
    pytest.importorskip("openai")
    whole = builder(fmt)
    whole.add(0, events(output))
    response = whole.response()
    message = response["choices"][0]["message"]
    expected_finish = "tool_calls" if calls else "stop"
    assert response["choices"][0]["finish_reason"] == expected_finish and message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])] \
        == calls
    streamed = builder(fmt)
    chunks = streamed.stream_head()
    for batch in events(output):
        chunks += streamed.chunks(0, [batch])
    final = accumulated(chunks).choices[0]
    assert final.finish_reason == expected_finish and final.message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls or []] == calls
    assert all(c.type == "function" and c.id.startswith("call_") for c in final.message.tool_calls or [])


def test_each_call_streams_once_with_its_index_and_the_last_chunk_says_tool_calls():
    output = HERMES_OUTPUTS[1][0]
    b = builder("hermes", n=2)
    chunks = [json.loads(c.removeprefix(b"data: ")) for c in b.chunks(0, events(output, step=5))
              + b.chunks(0, events("Plain.", index=1, finish=FinishReason.LENGTH))]
    deltas = [c["choices"][0] for c in chunks]
    entries = [t for d in deltas if d["index"] == 0 for t in d["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"], t["type"]) for t in entries] == [(0, "get_weather", "function"),
                                                                                (1, "local_time", "function")]
    assert [d["finish_reason"] for d in deltas if d["index"] == 0][-1] == "tool_calls"
    assert [d["finish_reason"] for d in deltas if d["index"] == 1][-1] == "length"
    assert "".join(d["delta"].get("content") or "" for d in deltas if d["index"] == 1) == "Plain."


def test_without_tools_the_text_is_all_content():
    b = builder(None)
    b.add(0, events(HERMES_OUTPUTS[0][0]))
    choice = b.response()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": HERMES_OUTPUTS[0][0]}
    assert choice["finish_reason"] == "stop"


# ---- the grammar of tool_choice "required" or a named tool ---------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(tmp_path_factory):
    llguidance = pytest.importorskip("llguidance")
    from tests.runtime.test_tokenizers import byte_level

    return llguidance.LLTokenizer(byte_level(tmp_path_factory.mktemp("ll")).to_str())


def matches(ll_tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize("name", [None, "get_weather", "local_time"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_grammar_compiles_and_matches_exactly_the_calls_the_parser_reads(ll_tokenizer, fmt, name, parallel):
    import llguidance

    grammar = call_grammar(TOOLS, fmt, parallel, name)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""
    key = "arguments" if fmt == "hermes" else "parameters"

    def written(calls):  # as the grammar lays them out: json.dumps's separators
        bodies = [json.dumps({"name": n, key: a}, ensure_ascii=False) for n, a in calls]
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies) if fmt == "hermes" else ";".join(bodies)

    for calls in ([("get_weather", ARGS)], [("local_time", {})], [("local_time", {}), ("get_weather", ARGS)]):
        text = written(calls)
        several = parallel and fmt == "hermes" and name is None  # a named tool is called once
        allowed = all(name in (None, n) for n, _ in calls) and (len(calls) == 1 or several)
        assert matches(ll_tokenizer, grammar, text) == allowed, text
        if allowed:
            assert calls_of(ToolCallParser(fmt, NAMES).parse(text)) == calls
    assert not matches(ll_tokenizer, grammar, written([("get_weather", {"unit": "C"})]))  # city is required
    assert not matches(ll_tokenizer, grammar, written([("local_time", {"x": 1})]))  # not a declared parameter
    assert not matches(ll_tokenizer, grammar, written([("launch", {})]))
    assert not matches(ll_tokenizer, grammar, "It is sunny.")


def test_required_and_a_named_choice_set_the_grammar_and_auto_none():
    assert request(tools=TOOLS).tool_use(HERMES).grammar is None
    assert request(tools=TOOLS, tool_choice="auto").tool_use(HERMES).grammar is None
    required = request(tools=TOOLS, tool_choice="required").tool_use(HERMES).grammar
    assert required == call_grammar(TOOLS, "hermes", True)
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "local_time"}},
                    parallel_tool_calls=False).tool_use(LLAMA31).grammar
    assert named == call_grammar(TOOLS, "llama3_json", False, "local_time") and "get_weather" not in named
    assert ToolUse.of(TOOLS, HERMES, required=True).grammar == required


# ---- malformed requests --------------------------------------------------------------------------

@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, {"type": "retrieval", "function": {"name": "x"}}]}, "tools[1].type"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "x",
                                                                                     "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "x", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_a_malformed_tool_field_is_refused_naming_it(fields, param):
    with pytest.raises(InvalidRequest) as e:
        request(**fields).conversation()
    assert e.value.field == param, e.value


# ---- live server ---------------------------------------------------------------------------------
#
# The engine bundle's context is 128 tokens: its template writes the tools' names only (and names the
# hermes format in a comment), and the tools' arguments are bounded (a string of at most 4 characters,
# or none), so that a call fits max_tokens.

SERVER_TEMPLATE = ("{# <tool_call> #}{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
                   "{% for m in messages %}{{ m.content or '' }}\n{% endfor %}")
SHORT = {"type": "function", "function": {"name": "rain", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}, "required": ["c"],
    "additionalProperties": False}}}
DRY = {"type": "function", "function": {"name": "dry", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}
SHORT_MESSAGES = [{"role": "user", "content": "Rain?"}]


@pytest.fixture(scope="module")
def tool_server(engine_bundle, tmp_path_factory):
    """The engine bundle with SERVER_TEMPLATE."""
    from tests.fronts.server_harness import templated_server

    with templated_server(engine_bundle, tmp_path_factory.mktemp("tools"), SERVER_TEMPLATE) as srv:
        yield srv


def post(srv, body: dict):
    httpx2 = pytest.importorskip("httpx2")
    with httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        return h.post("/v1/chat/completions", content=json.dumps(body))


def test_a_server_renders_the_tools_into_the_prompt_and_answers_a_message(tool_server):
    from service.client import Client

    body = {"messages": SHORT_MESSAGES, "max_tokens": 6, "temperature": 0}
    with Client(tool_server.address) as grpc:
        with_tools = len(grpc.tokenize("rain dry Rain?\n").token_ids)
        without = len(grpc.tokenize("Rain?\n").token_ids)
    answer = post(tool_server, {**body, "tools": [SHORT, DRY]}).json()
    assert answer["usage"]["prompt_tokens"] == with_tools > without
    assert answer["choices"][0]["message"]["role"] == "assistant"
    answer = post(tool_server, {**body, "tools": [SHORT, DRY], "tool_choice": "none"}).json()
    assert answer["usage"]["prompt_tokens"] == without
    refused = post(tool_server, {**body, "tools": [SHORT], "tool_choice": {"type": "function",
                                                                          "function": {"name": "dry"}}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice.function.name"


def test_a_second_constraint_or_parameters_that_do_not_compile_are_a_400_naming_tool_choice(tool_server):
    body = {"messages": SHORT_MESSAGES, "max_tokens": 4, "tools": [SHORT], "tool_choice": "required"}
    both = post(tool_server, {**body, "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice", both.text
    assert "response_format" in both.json()["error"]["message"]
    bogus = {"type": "function", "function": {"name": "rain", "parameters": {
        "type": "object", "properties": {"c": {"type": "string", "format": "no-such-format"}}}}}
    refused = post(tool_server, {**body, "tools": [bogus]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice", refused.text
    assert post(tool_server, {**body, "tools": [bogus], "tool_choice": "auto"}).status_code == 200


def test_a_streamed_answer_with_tools_adds_up_to_the_whole_one(tool_server):
    openai = pytest.importorskip("openai")
    fields = dict(model="", messages=SHORT_MESSAGES, tools=[SHORT, DRY], max_tokens=12, temperature=0, n=2,
                  extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=tool_server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
        whole = api.chat.completions.create(**fields)
        streamed = accumulated(api.chat.completions.create(stream=True, **fields))
    for a, b in zip(whole.choices, streamed.choices, strict=True):
        assert (a.message.content, a.message.tool_calls, a.finish_reason) == \
            (b.message.content, b.message.tool_calls, b.finish_reason)
        assert a.message.content


# ---- with the engine applying the grammar --------------------------------------------------------

def test_enforced_required_calls_a_tool_with_arguments_of_its_schema(tool_server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=tool_server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
        out = api.chat.completions.create(model="", messages=SHORT_MESSAGES, tools=[SHORT, DRY],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                          temperature=0.8, seed=3)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.function.name in ("rain", "dry") and isinstance(json.loads(call.function.arguments), dict)
            if call.function.name == "rain":
                assert len(json.loads(call.function.arguments)["c"]) <= 4
        named = api.chat.completions.create(model="", messages=SHORT_MESSAGES, tools=[SHORT, DRY], max_tokens=100,
                                            tool_choice={"type": "function", "function": {"name": "rain"}},
                                            parallel_tool_calls=False, temperature=0.8, seed=3)
        assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["rain"], named.choices[0]


def test_enforced_a_streamed_call_accumulates_to_the_whole_one(tool_server):
    openai = pytest.importorskip("openai")
    fields = dict(model="", messages=SHORT_MESSAGES, tools=[SHORT, DRY], max_tokens=100, temperature=0.8, seed=5,
                  tool_choice={"type": "function", "function": {"name": "rain"}}, parallel_tool_calls=False)
    with openai.OpenAI(base_url=tool_server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
        whole = api.chat.completions.create(**fields).choices[0].message.tool_calls
        with api.chat.completions.stream(**fields) as stream:
            streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert whole and [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
