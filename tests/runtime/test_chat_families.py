"""Chat templates in the prompt formats of today's model families (tests/runtime/chat_templates/, written for
these tests) render as transformers' `apply_chat_template` renders them: with a system message, tools, an
assistant's earlier calls (one, or several at once) and their results, reasoning in the history, the
template's own variables (`enable_thinking`, `xml_tools`, `tools_in_user_message`), with and without the
generation prompt. A conversation a template refuses is refused by both. The date a template shows is given
as `date_string`, so that a run across midnight compares one date; without it the template asks for today's."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from service.runtime.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402
from tests.runtime.test_tokenizers import byte_level  # noqa: E402

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = {  # template file -> (bos, eos) of its tokenizer
    "qwen3": ("<|endoftext|>", "<|im_end|>"), "gemma3": ("<bos>", "<eos>"),
    "gemma3_tools_pythonic": ("<bos>", "<eos>"), "phi4_mini": ("<|endoftext|>", "<|endoftext|>"),
    "llama3.2": ("<|begin_of_text|>", "<|eot_id|>"), "smollm3": ("<|im_start|>", "<|im_end|>"),
    "gemma2": ("<bos>", "<eos>"), "phi3_mini": ("<s>", "<|endoftext|>"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
LOCAL_TIME = {"type": "function", "function": {"name": "local_time", "description": "The time where the user is."}}
ARGS = {"city": "Zürich", "unit": "C"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
TIME_CALL = {"id": "call_2", "type": "function", "function": {"name": "local_time", "arguments": {}}}

SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! naïve café, 東京"}]
MULTI_TURN = [*SYSTEM, {"role": "assistant", "content": "  Bonjour.  "}, {"role": "user", "content": "Encore"}]
REASONED = [{"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two.\n"},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"}]
TOOL_TURNS = [*SYSTEM, {"role": "assistant", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]
PARALLEL_TURNS = [*SYSTEM, {"role": "assistant", "tool_calls": [CALL, TIME_CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "09:30"}]
PHI4_TOOLS = [{"role": "system", "content": "You are a helpful assistant with some tools.",
               "tools": json.dumps([WEATHER["function"]])}, {"role": "user", "content": "Weather in Paris?"}]

# (conversation, tools, template variables)
CASES = {
    "user_only": (MULTI_TURN[1:], None, {}),
    "system": (SYSTEM, None, {}),
    "multi_turn": (MULTI_TURN, None, {}),
    "reasoned": (REASONED, None, {}),
    "tools": (SYSTEM, [WEATHER], {}),
    "tool_turns": (TOOL_TURNS, [WEATHER], {}),
    "no_thinking": (MULTI_TURN, None, {"enable_thinking": False}),
    "xml_tools": (SYSTEM, None, {"xml_tools": [WEATHER], "enable_thinking": False}),
    "phi4_tools": (PHI4_TOOLS, None, {}),
    "tools_in_system": (TOOL_TURNS, [WEATHER], {"tools_in_user_message": False}),
    "parallel_calls": (PARALLEL_TURNS, [WEATHER, LOCAL_TIME], {}),
}
TODAY = {"date_string": "27 Nov 2026"}  # every case's date, for the templates that show one
# the conversations a template refuses, through its raise_exception or by failing on them
REFUSED = {("gemma3", "tool_turns"), ("gemma3", "tools_in_system"), ("gemma3", "parallel_calls"),
           ("phi3_mini", "tool_turns"), ("phi3_mini", "tools_in_system"), ("phi3_mini", "parallel_calls"),
           ("llama3.2", "parallel_calls"),
           *(("gemma2", case) for case in ("system", "multi_turn", "tools", "tool_turns", "no_thinking", "xml_tools",
                                           "phi4_tools", "tools_in_system", "parallel_calls"))}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("byte_level")
    byte_level(path).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tokenizer_dir, tmp_path_factory):
    """(name, our template, transformers' tokenizer), both from the family's template saved as transformers saves it."""
    from tokenizers import Tokenizer as HFTokenizer

    name = request.param
    bos, eos = FAMILIES[name]
    path = tmp_path_factory.mktemp(name)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json")), bos_token=bos, eos_token=eos)
    fast.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    fast.save_pretrained(path)
    return name, ChatTemplate.from_bundle(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_a_family_template_renders_as_transformers_apply_chat_template(family, case, generation_prompt):
    name, template, auto = family
    messages, tools, variables = CASES[case]
    variables = {**TODAY, **variables}
    try:
        theirs = auto.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                          tokenize=False, **variables)
    except Exception:  # noqa: BLE001 - any refusal of transformers' must be ours too
        assert (name, case) in REFUSED
        with pytest.raises(ChatTemplateError):
            template.render(messages, add_generation_prompt=generation_prompt, tools=tools, **variables)
        return
    assert (name, case) not in REFUSED
    ours = template.render(messages, add_generation_prompt=generation_prompt, tools=tools, **variables)
    assert ours == theirs


def test_what_the_family_templates_show_the_model(tokenizer_dir):
    """The renderings compared above hold what each family's model needs to see."""
    qwen3 = ChatTemplate((TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"))
    rendered = qwen3.render(TOOL_TURNS, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n</tool_call>' in rendered
    assert qwen3.render(SYSTEM, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.render(SYSTEM).endswith("<|im_start|>assistant\n")
    assert "<think>\nThree and three.\n</think>\n\n6" in qwen3.render(REASONED, add_generation_prompt=False)
    smollm3 = ChatTemplate((TEMPLATES / "smollm3.jinja").read_text(encoding="utf-8"))
    assert "Reasoning Mode: /think" in smollm3.render(SYSTEM)
    assert smollm3.render(SYSTEM, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    switched = smollm3.render([{"role": "system", "content": "Be brief. /no_think"}, *SYSTEM[1:]])
    assert "Reasoning Mode: /no_think\n" in switched and "\nBe brief.\n" in switched
    assert switched.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    gemma = ChatTemplate((TEMPLATES / "gemma3_tools_pythonic.jinja").read_text(encoding="utf-8"), {"bos_token": "<bos>"})
    assert '<start_of_turn>model\n[get_weather(city="Zürich"' in gemma.render(TOOL_TURNS, tools=[WEATHER])
    parallel = gemma.render(PARALLEL_TURNS, tools=[WEATHER, LOCAL_TIME])
    assert '<start_of_turn>model\n[get_weather(city="Zürich", unit="C"), local_time()]<end_of_turn>' in parallel
    assert '<start_of_turn>user\n```tool_output\n{"temp": 21}\n```\n```tool_output\n09:30\n```<end_of_turn>' in parallel
    phi4 = ChatTemplate((TEMPLATES / "phi4_mini.jinja").read_text(encoding="utf-8"))
    assert phi4.render(PHI4_TOOLS).startswith('<|system|>You are a helpful assistant with some tools.<|tool|>[{"name"')
    assert ('<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}]'
            '<|/tool_call|><|end|>') in phi4.render(TOOL_TURNS)
    llama = ChatTemplate((TEMPLATES / "llama3.2.jinja").read_text(encoding="utf-8"))
    rendered = llama.render(TOOL_TURNS, tools=[WEATHER], **TODAY)
    assert "Environment: ipython\n" in rendered and "Today Date: 27 Nov 2026\n" in rendered
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Zürich", '
            '"unit": "C"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}<|eot_id|>') in rendered


def test_without_a_date_string_a_template_shows_today(family):
    """`strftime_now`: ours and transformers' give the same day, unless the day changed between the renderings."""
    name, template, auto = family

    def today() -> set[str]:
        now = datetime.now()
        return {now.strftime("%d %b %Y"), now.strftime("%d %B %Y")}

    before = today()
    ours = template.render(SYSTEM[1:])
    theirs = auto.apply_chat_template(SYSTEM[1:], add_generation_prompt=True, tokenize=False)
    after = today()
    if before == after:
        assert ours == theirs
    if name in ("llama3.2", "smollm3"):
        assert any(f"Today Date: {day}\n" in ours for day in before | after)


def test_the_generation_block_renders_its_body_and_namespaces_refuse_underscore_names():
    assert ChatTemplate("a{% generation %}b{{ 1 + 1 }}{% endgeneration %}c").render([]) == "ab2c"
    assert ChatTemplate("{{ dict(a=1)['a'] }}").render([]) == "1"
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace() %}{% set ns.__class__ = 1 %}").render([])


def test_reasoning_reaches_the_template_under_each_of_its_names():
    template = ChatTemplate("{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}")
    messages = [{"role": "assistant", "content": "a", "reasoning": "r1"},
                {"role": "assistant", "content": "b", "thinking": "r2"}, {"role": "user", "content": "c"}]
    assert template.render(messages, add_generation_prompt=False) == "r1|r1;r2|r2;|;"
    assert messages[0] == {"role": "assistant", "content": "a", "reasoning": "r1"}  # the caller's dicts are unchanged


def test_a_template_that_fails_on_a_variable_is_refused_not_a_crash():
    template = ChatTemplate("{{ 1 // days }}{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        template.render([{"role": "user", "content": "x"}], days=0)
    assert template.render([{"role": "user", "content": "x"}], days=1) == "1x"
