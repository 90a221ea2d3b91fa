"""Structured output on the HTTP front: the body's constraint fields as the engine's one `Constraint`.

    response_format {"type": "json_object"}                         -> json_object
    response_format {"type": "json_schema", "json_schema": {...}}   -> json_schema (its "schema")
    guided_json, guided_regex, guided_choice, guided_grammar       -> vLLM's, the same five kinds
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}
    tool_choice "required" or a named tool (chat)                  -> grammar (service.fronts.tool_calls)

A request takes one constraint at most; the field that set it names the engine's errors about it. A chat
output that may write a reasoning section is constrained after it (`after_reasoning`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from service.engine.errors import InvalidRequest
from service.engine.request import Constraint
from service.fronts.http.openai_schema import SamplingFields
from service.fronts.reasoning import SectionStart, reasoning_lead
from service.fronts.tool_calls import ToolUse

# the answer of an output constrained only for its reasoning section's bound: any text that does not open a
# section (else a `<think>` could begin the answer, and the section in it would be unbounded)
ANY_ANSWER = "start: ANSWER\nANSWER: /(?s:.*)/ & ~/\\s*<think>(?s:.*)/"


def constraint_of(body: SamplingFields, tools: ToolUse | None = None) -> tuple[Constraint | None, str]:
    """The body's constraint, and the field that asked for it ("" when there is none); `tools`: a chat's,
    whose `tool_choice` "required" or named tool is a grammar."""
    tool_grammar = Constraint("grammar", tools.grammar) if tools is not None and tools.grammar else None
    asked = [(name, c) for name, c in [*_asked(body), ("tool_choice", tool_grammar)] if c is not None]
    if len(asked) > 1:
        raise InvalidRequest(asked[1][0], f"a request takes one constraint, and {asked[0][0]} sets one already")
    return asked[0][1] if asked else None, asked[0][0] if asked else ""


def after_reasoning(constraint: Constraint | None, start: SectionStart | None,
                    max_chars: int | None) -> Constraint | None:
    """`constraint` on the answer after a chat output's reasoning section (`start`, as
    `service.fronts.reasoning.output_start` reads the prompt), never on the section itself. With `max_chars`, the
    section is bounded by the grammar, so an output without a constraint gets one: the bounded section, then any
    text."""
    if start is None or start == "after":  # no section to write
        return constraint
    if constraint is None:
        if max_chars is None:
            return None
        constraint = Constraint("grammar", ANY_ANSWER)
    return replace(constraint, lead=reasoning_lead(start, max_chars))


def _asked(body: SamplingFields):
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        yield "response_format", Constraint("json_object")
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequest("response_format.json_schema.schema", "is required with type json_schema")
        yield "response_format.json_schema.schema", _schema(rf.json_schema.schema_)
    yield "guided_json", _schema(body.guided_json)
    yield "guided_regex", _text("regex", body.guided_regex)
    yield "guided_choice", _choice(body.guided_choice)
    yield "guided_grammar", _text("grammar", body.guided_grammar)
    so = body.structured_outputs
    if so is not None:
        yield "structured_outputs.json", _schema(so.json_)
        yield "structured_outputs.regex", _text("regex", so.regex)
        yield "structured_outputs.choice", _choice(so.choice)
        yield "structured_outputs.grammar", _text("grammar", so.grammar)
        yield "structured_outputs.json_object", Constraint("json_object") if so.json_object else None


def _schema(schema: dict[str, Any] | str | None) -> Constraint | None:
    if schema is None:
        return None
    return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _text(kind: str, value: str | None) -> Constraint | None:
    return None if value is None else Constraint(kind, value)


def _choice(choices: list[str] | None) -> Constraint | None:
    return None if choices is None else Constraint("choice", json.dumps(choices))
