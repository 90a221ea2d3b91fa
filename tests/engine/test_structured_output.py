"""Structured output in the engine: every sequence of a constrained request matches its grammar, alone,
batched, sampled and with n > 1; the unconstrained rows beside it are unchanged; bad constraints are
refused before they reach the engine's state."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from service.engine.errors import InvalidRequest
from service.engine.request import Constraint, FinishReason, GenerationRequest, SamplingParams, StoppingCriteria
from tests.engine.harness import beam, greedy, random_prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "home": {"type": "object", "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                 "required": ["floor"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
}


def constrained(rid: str, prompt: list[int], constraint: Constraint, max_new: int = 120, seed: int = 0,
                n: int = 1, temperature: float = 1.0) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(temperature=temperature, seed=seed),
                             StoppingCriteria(max_new_tokens=max_new), n=n, constraint=constraint)


def texts(engine, done) -> dict[tuple[str, int], tuple[str, FinishReason]]:
    out = {}
    for result in done:
        assert result.error is None, result.error
        for index in {e.index for e in result.events}:
            events = [e for e in result.events if e.index == index]
            out[(result.request_id, index)] = ("".join(e.text for e in events), events[-1].finish_reason)
    return out


def test_json_schema_output_validates_sampled_batched_and_with_n(make_engine):
    engine = make_engine()
    rng = np.random.default_rng(0)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    done = engine.generate([constrained(f"j{i}", random_prompt(rng, 5), c, seed=i, n=2) for i in range(6)])
    results = texts(engine, done)
    assert len(results) == 12
    for (rid, index), (text, reason) in results.items():
        assert reason is FinishReason.STOP, (rid, index, text)
        jsonschema.validate(json.loads(text), SCHEMA)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", outside_strings), text  # compact JSON: no whitespace the model chose


def test_regex_choice_and_grammar(make_engine):
    engine = make_engine()
    rng = np.random.default_rng(1)
    cases = {
        "regex": (Constraint("regex", r"[a-z]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", t)),
        "choice": (Constraint("choice", json.dumps(["yes", "no", "maybe not"])),
                   lambda t: t in ("yes", "no", "maybe not")),
        "lark": (Constraint("grammar", 'start: ("red" | "blue") " " NUM\nNUM: /[1-9][0-9]?/'),
                 lambda t: re.fullmatch(r"(red|blue) [1-9][0-9]?", t)),
        "gbnf": (Constraint("grammar", 'root ::= "x" [0-9] [0-9]'), lambda t: re.fullmatch(r"x[0-9][0-9]", t)),
    }
    requests = [constrained(f"{name}{seed}", random_prompt(rng, 4), c, max_new=40, seed=seed)
                for name, (c, _) in cases.items() for seed in range(4)]
    for (rid, _), (text, reason) in texts(engine, engine.generate(requests)).items():
        check = cases[rid[:-1]][1]
        assert check(text), (rid, text)
        assert reason is FinishReason.STOP


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(make_engine):
    engine = make_engine()
    rng = np.random.default_rng(2)
    prompts = [random_prompt(rng, 6) for _ in range(3)]
    alone = [engine.generate([greedy(f"a{i}", p, 20)])[0].token_ids() for i, p in enumerate(prompts)]
    c = Constraint("json_schema", json.dumps(SCHEMA))
    mixed = engine.generate([greedy(f"b{i}", p, 20) for i, p in enumerate(prompts)]
                            + [constrained(f"c{i}", random_prompt(rng, 5), c, seed=i) for i in range(3)])
    assert [r.token_ids() for r in mixed[:3]] == alone


def test_a_seeded_constrained_request_is_the_same_alone_and_batched(make_engine):
    engine = make_engine()
    rng = np.random.default_rng(3)
    prompt = random_prompt(rng, 6)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    alone = engine.generate([constrained("s", prompt, c, seed=7)])[0].token_ids()
    others = [constrained(f"o{i}", random_prompt(rng, 3 + i), c, seed=i) for i in range(4)]
    batched = engine.generate(others[:2] + [constrained("s", prompt, c, seed=7)] + others[2:])[2].token_ids()
    assert batched == alone


def test_max_new_tokens_before_the_grammar_completes_ends_with_length(make_engine):
    engine = make_engine()
    c = Constraint("json_schema", json.dumps(SCHEMA))
    [done] = engine.generate([constrained("short", [5, 6, 7], c, max_new=4)])
    assert len(done.events) == 4 and done.events[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", "{not json"), "json schema cannot be used"),
    (Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})),
     "does not compile"),
    (Constraint("regex", "a(b"), "regex does not compile"),
    (Constraint("grammar", "start: missing_rule"), "grammar does not compile"),
    (Constraint("choice", "[]"), "non-empty list"),
    (Constraint("choice", json.dumps(["a", 3])), "non-empty list"),
])
def test_bad_constraints_are_refused_by_name(make_engine, constraint, message):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=message) as e:
        engine.new_request(constrained("bad", [1, 2], constraint))
    assert e.value.field == "constraint"
    assert not engine.has_work


def test_compiled_grammars_are_cached_by_content(make_engine):
    engine = make_engine()
    c = Constraint("regex", "[0-9]{3}")
    first = engine.grammars.compile(c)
    assert engine.grammars.compile(Constraint("regex", "[0-9]{3}")) is first
    assert engine.grammars.cached(Constraint("regex", "[0-9]{4}")) is None


def test_a_tokenizer_without_bytes_per_token_refuses_constraints_and_still_serves(make_engine, seq2seq_bundle):
    engine = make_engine(bundle=seq2seq_bundle)
    engine.warm_up()  # does not fail for it
    with pytest.raises(InvalidRequest, match="not available for this model"):
        engine.new_request(constrained("g2p", [5, 6, 7], Constraint("regex", "[A-Z]+"), max_new=4))
    [done] = engine.generate([greedy("plain", [5, 6, 7], 4)])
    assert done.error is None and done.events


def test_a_constraint_with_beam_search_is_refused_by_name(make_engine):
    """Beam search ranks whole hypotheses by the model's log-probabilities; a grammar would mask some beams'
    tokens and not others, so the pair is refused before it reaches the engine, naming the field."""
    r = beam("b", [5, 6, 7], width=3, n=1, max_new=8)
    r.constraint = Constraint("regex", "[a-z]+")
    with pytest.raises(InvalidRequest) as refused:
        make_engine().new_request(r)
    assert refused.value.field == "constraint" and "beam search" in str(refused.value)
