"""The tokens a constraint may emit are decided the same way by the mask and by the matcher, whatever the
tokenizer's added tokens: an added token that is not special (Qwen2.5's `<tool_call>`) is the text it
stands for, a special one (`<|im_end|>`, Hermes' `<tool_call>`, Llama 3's `<|python_tag|>`) is never allowed
inside a constraint, EOS only where the grammar may end. A constraint after a reasoning section (its `lead`) is
walked the same way.

Every constraint kind is walked token by token with random choices among the allowed ones: each choice
must be consumed, and the text must match the constraint."""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("llguidance")
transformers = pytest.importorskip("transformers")

from service.engine.grammar import Grammars, allowed  # noqa: E402
from service.engine.request import Constraint  # noqa: E402
from service.fronts.http.structured import after_reasoning  # noqa: E402
from service.fronts.reasoning import THINK_CLOSE, ReasoningParser, reasoning_lead  # noqa: E402
from service.fronts.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolCallParser, call_grammar  # noqa: E402
from service.runtime.tokenizer import Tokenizer  # noqa: E402
from tests.engine.token_families import FAMILIES, added_ids, with_family_tokens  # noqa: E402
from tests.runtime.test_tokenizers import byte_level, sentencepiece_style  # noqa: E402

FREE_TOKENS = 24  # tokens chosen freely before a walk heads for the end
PADDING = 3  # logits wider than the tokenizer, as padded checkpoints have them
TOOLS = [{"type": "function", "function": {"name": "rain", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}, "required": ["c"]}}},
         {"type": "function", "function": {"name": "dry"}}]
SCHEMA = {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 12},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["tag", "n"], "additionalProperties": False}
CHOICES = ["<tool_call>", "<|im_end|> done", "plain"]


def constraints() -> dict[str, tuple[Constraint, object]]:
    """name -> (constraint, check(text, family) -> bool)."""
    def calls(fmt, name=None):
        def check(text, _family):
            parsed = ToolCallParser(fmt, {"rain", "dry"}).parse(text)
            return parsed.content is None and len(parsed.calls) >= 1 and all(
                name in (None, c.name) and isinstance(json.loads(c.arguments), dict) for c in parsed.calls)
        return check

    return {
        "required-hermes": (Constraint("grammar", call_grammar(TOOLS, "hermes", True)), calls("hermes")),
        "named-hermes": (Constraint("grammar", call_grammar(TOOLS, "hermes", False, "rain")), calls("hermes", "rain")),
        "required-llama3": (Constraint("grammar", call_grammar(TOOLS, "llama3_json", False)), calls("llama3_json")),
        "json_schema": (Constraint("json_schema", json.dumps(SCHEMA)),
                        lambda t, _: set(json.loads(t)) == {"tag", "n"}),
        "json_object": (Constraint("json_object"), lambda t, _: isinstance(json.loads(t), dict)),
        "regex": (Constraint("regex", r"<tool_call>[a-z]{1,6}</tool_call>"),
                  lambda t, _: re.fullmatch(r"<tool_call>[a-z]{1,6}</tool_call>", t) is not None),
        "choice": (Constraint("choice", json.dumps(CHOICES)), lambda t, _: t in CHOICES),
        "special-text": (Constraint("grammar", 'start: "<|im_end|><|python_tag|>" /[0-9]{1,3}/'),
                         lambda t, _: re.fullmatch(r"<\|im_end\|><\|python_tag\|>[0-9]{1,3}", t) is not None),
    }


@pytest.fixture(scope="module", params=[(layout, family) for layout in ("byte-level", "sentencepiece")
                                        for family in FAMILIES], ids=lambda p: f"{p[0]}-{p[1]}")
def vocabulary(request, tmp_path_factory):
    layout, family = request.param
    build = byte_level if layout == "byte-level" else sentencepiece_style
    hf = with_family_tokens(build(tmp_path_factory.mktemp("tok")), family)
    eos = hf.token_to_id("<|im_end|>" if family != "llama3" else "<|eot_id|>")
    grammars = Grammars(Tokenizer(hf, eos), hf.get_vocab_size() + PADDING, [eos])
    closers = {i for i in range(hf.get_vocab_size()) if hf.decode([i]) in ('"', "}", "]", '"}', '"]', "}}")}
    return family, hf, eos, grammars, closers


def walk(grammars: Grammars, constraint: Constraint, eos: int, closers: set[int], seed: int) -> tuple[list[int], set[int]]:
    """Random allowed tokens until EOS; every allowed token seen along the way. Each choice must be consumed.
    Past FREE_TOKENS, EOS and then `closers` (tokens that end a string or an object) are taken when allowed,
    so that an unbounded constraint (any JSON object) ends."""
    matcher = grammars.compile(constraint).matcher()
    rng = random.Random(seed)
    tokens, seen = [], set()
    for _ in range(200):
        options = [int(t) for t in allowed(grammars.masks([matcher]), grammars.vocab_size)[0].nonzero()[0]]
        assert options, f"nothing allowed after {tokens}"
        seen.update(options)
        ending = [t for t in options if t == eos] or [t for t in options if t in closers]
        token = rng.choice(ending if len(tokens) > FREE_TOKENS and ending else options)
        assert matcher.consume_token(token), f"the mask allowed {token} and the matcher refused it: {tokens}"
        if token == eos:
            return tokens, seen
        tokens.append(token)
    raise AssertionError(f"no end after 200 tokens: {tokens}")


@pytest.mark.parametrize("name", list(constraints()))
def test_every_allowed_token_is_consumed_and_the_text_matches(vocabulary, name):
    family, hf, eos, grammars, closers = vocabulary
    constraint, check = constraints()[name]
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    for seed in range(4):
        tokens, seen = walk(grammars, constraint, eos, closers, seed)
        text = hf.decode(tokens, skip_special_tokens=False)
        assert check(text, family), (name, text)
        # a special token, or a padding id, is never allowed inside a constraint; EOS only at its end
        assert not (seen - {eos}) & (special | set(range(hf.get_vocab_size(), grammars.vocab_size))), text
        # what the server shows: special tokens left out of the text (they are not in it)
        assert hf.decode(tokens, skip_special_tokens=True) == text


def test_an_added_token_that_is_not_special_is_the_text_it_stands_for(vocabulary):
    family, hf, eos, grammars, _ = vocabulary
    ids = added_ids(hf, family)
    matcher = grammars.compile(Constraint("grammar", call_grammar(TOOLS, "hermes", False, "rain"))).matcher()
    first = set(allowed(grammars.masks([matcher]), grammars.vocab_size)[0].nonzero()[0].tolist())
    if family == "qwen2.5":  # the model's own token for the tag is among the ways to write it
        assert ids[HERMES_OPEN] in first and matcher.consume_token(ids[HERMES_OPEN])
    else:
        assert not first & set(ids.values())
    if HERMES_CLOSE in ids:  # the server's text keeps an added token that is not special, as transformers does
        assert hf.decode([ids[HERMES_CLOSE]], skip_special_tokens=True) == (HERMES_CLOSE if family == "qwen2.5" else "")


@pytest.mark.parametrize("start", ["inside", "before"])
@pytest.mark.parametrize("name", ["json_schema", "required-hermes", "choice"])
def test_a_reasoning_lead_comes_before_the_constrained_answer(vocabulary, start, name):
    """A chat constraint after a reasoning section (`service.fronts.reasoning.reasoning_lead`): whatever the
    walk writes, the section (at most its bound, then `</think>`) reads apart, and the answer matches."""
    family, hf, eos, grammars, closers = vocabulary
    constraint, check = constraints()[name]
    led = Constraint(constraint.kind, constraint.value, reasoning_lead(start, max_chars=12))
    for seed in range(4):
        tokens, _ = walk(grammars, led, eos, closers, seed)
        text = hf.decode(tokens, skip_special_tokens=False)
        message = ReasoningParser(start).parse(text)
        assert message.content is not None and check(message.content, family), (start, name, text)
        assert len(message.reasoning or "") <= 12, text
        assert (THINK_CLOSE in text) if start == "inside" else (text.lstrip().startswith("<think>") or
                                                                check(text, family)), text


@pytest.mark.parametrize("start", ["inside", "before"])
def test_a_bounded_section_before_free_text_stays_bounded(vocabulary, start):
    """`max_reasoning_chars` without a constraint: the section is bounded, and the free answer after it cannot
    open another (a `<think>` there would start an unbounded one)."""
    _, hf, eos, grammars, closers = vocabulary
    constraint = after_reasoning(None, start, 12)
    for seed in range(4):
        tokens, _ = walk(grammars, constraint, eos, closers, seed)
        text = hf.decode(tokens, skip_special_tokens=False)
        message = ReasoningParser(start).parse(text)
        assert len(message.reasoning or "") <= 12, text
        assert not (message.content or "").lstrip().startswith("<think>"), text
