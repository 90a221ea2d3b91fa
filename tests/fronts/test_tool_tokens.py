"""Constraints on a model whose tokenizer adds the chat family's tokens: Qwen2.5's (`<tool_call>` added but not
special), Hermes' (the tool tags special) and Llama 3's (`<|python_tag|>` and the headers special). Forced
tool calls (`tool_choice` "required" or a named tool), whole and streamed, give valid `tool_calls` over HTTP,
and every constraint kind gives matching text over gRPC, whole and streamed.

One lively model serves the three: each family adds FAMILY_TOKENS tokens after the same trained BPE. A special
tag is spelled in ordinary tokens under a constraint, so a call takes up to 100 tokens."""

from __future__ import annotations

import json
import re

import pytest

from service.fronts.tool_calls import call_grammar
from tests.engine.token_families import FAMILIES, FAMILY_TOKENS, with_family_tokens
from tests.fronts.server_harness import ServerThread, free_port, settings, with_chat_template

pytestmark = pytest.mark.needs_torch(reason="builds its models with torch")
openai = pytest.importorskip("openai")

# compact templates (the model's context is 128 tokens) that name each format as the families' templates do
TEMPLATES = {"qwen2.5": "{# <tool_call> #}{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
                        "{% for m in messages %}{{ m.content or '' }}\n{% endfor %}",
             "llama3": "{# <|python_tag|> #}{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
                       "{% for m in messages %}{{ m.content or '' }}\n{% endfor %}"}
TEMPLATES["hermes"] = TEMPLATES["qwen2.5"]
RAIN = {"type": "function", "function": {"name": "rain", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}, "required": ["c"],
    "additionalProperties": False}}}
DRY = {"type": "function", "function": {"name": "dry", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Rain?"}]
CHOICES = [{"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "rain"}}}]


@pytest.fixture(scope="module")
def family_bundles(tmp_path_factory, tiny_tokenizer) -> dict:
    """family -> a bundle of one lively model with that family's tokenizer and a template of its format."""
    from export.bundle_writer import export_bundle
    from model.checkpoint import save_model_dir
    from service.runtime.tokenizer import Tokenizer
    from tests.conftest import make_lively

    root = tmp_path_factory.mktemp("families")
    model = make_lively(vocab_size=tiny_tokenizer.vocab_size + FAMILY_TOKENS, n_ctx=128)
    bundles = {}
    for family in FAMILIES:
        save_model_dir(model, Tokenizer(with_family_tokens(tiny_tokenizer.hf, family)), root / family / "model")
        export_bundle(root / family / "model", root / family / "exported", name=f"tiny-{family}")
        bundles[family] = with_chat_template(root / family / "exported", root / family, TEMPLATES[family])
    return bundles


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, family_bundles):
    with ServerThread(settings(family_bundles[request.param], http_port=free_port())) as srv:
        yield request.param, srv


def accumulated_calls(stream) -> tuple[list[tuple[str, str]], str]:
    """The calls and the finish reason a streamed chat completion adds up to."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                name, args = calls.setdefault(delta.index, ["", ""])
                calls[delta.index] = [name + (delta.function.name or ""), args + (delta.function.arguments or "")]
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named"])
def test_forced_tool_calls_are_valid_whole_and_streamed(family_server, choice):
    _, srv = family_server
    fields = dict(model="", messages=MESSAGES, tools=[RAIN, DRY], max_tokens=100, temperature=0.8,
                  parallel_tool_calls=False, **choice)
    names = {"rain"} if isinstance(choice["tool_choice"], dict) else {"rain", "dry"}
    with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as api:
        for seed in range(3):
            whole = api.chat.completions.create(seed=seed, **fields).choices[0]
            assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole
            call = whole.message.tool_calls[0]
            assert call.function.name in names and isinstance(json.loads(call.function.arguments), dict)
            streamed, finish = accumulated_calls(api.chat.completions.create(seed=seed, stream=True, **fields))
            assert finish == "tool_calls" and streamed == [(call.function.name, call.function.arguments)]


def grpc_constraints() -> dict:
    """name -> (request fields, check(text))."""
    grammar = call_grammar([RAIN, DRY], "hermes", False)
    tag = r"<tool_call>[a-z]{1,4}</tool_call>"
    return {
        "grammar": ({"grammar": grammar}, lambda t: t.startswith("<tool_call>\n{") and t.endswith("}\n</tool_call>")),
        "regex": ({"regex": tag}, lambda t: re.fullmatch(tag, t) is not None),
        "choice": ({"choice": {"choices": ["<tool_call>", "<|im_end|>", "no"]}},
                   lambda t: t in ("<tool_call>", "<|im_end|>", "no")),
        "json_schema": ({"json_schema": json.dumps(RAIN["function"]["parameters"])},
                        lambda t: set(json.loads(t)) == {"c"}),
    }


@pytest.mark.parametrize("kind", list(grpc_constraints()))
def test_every_constraint_kind_matches_over_grpc_whole_and_streamed(family_server, kind):
    from attnserve.v1 import generate_pb2 as pb
    from service.client import Client

    _, srv = family_server
    fields, check = grpc_constraints()[kind]
    with Client(srv.address, timeout_s=60) as client:
        for seed in range(3):
            request = dict(temperature=0.8, seed=seed, max_new_tokens=100, **fields)
            whole = client.generate("Rain?", **request).completions[0]
            assert whole.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and check(whole.text), whole
            assert "".join(client.stream("Rain?", **request)) == whole.text
