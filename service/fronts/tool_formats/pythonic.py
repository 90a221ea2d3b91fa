"""pythonic (Gemma 3 with vLLM's tool template, Llama 3.2's pythonic template): the whole output is a Python
list of calls with keyword arguments, `[get_weather(city="Paris", unit="C"), local_time()]`, each value a
literal. Values are read as JSON where they are JSON (`true`, `null`, as a constrained call writes them)
and else as Python literals (`True`, `None`, 'single quotes')."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from service.fronts.tool_formats.base import ToolCall
from service.fronts.tool_formats.whole import WholeStream

NAME = re.compile(r"\s*([A-Za-z0-9_-]+)\s*\(\s*")
KEYWORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
SEPARATOR = re.compile(r"\s*(,)?\s*")
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps's


class PythonicStream(WholeStream):
    starts = ("[",)

    def calls(self, text: str) -> list[ToolCall] | None:
        if not (text.startswith("[") and text.endswith("]")):
            return None
        found = _json_valued(text) or _python_valued(text)
        if not found or any(name not in self.tool_names for name, _ in found):
            return None
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in found]


def _json_valued(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of `text` whose values are all JSON, or None."""
    try:
        return _scan_json_valued(text)
    except IndexError:  # the text ended inside a call
        return None


def _scan_json_valued(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    decoder, calls, at = json.JSONDecoder(), [], 1
    while True:
        name = NAME.match(text, at)
        if name is None:
            return None
        at, arguments = name.end(), {}
        while text[at] != ")":
            keyword = KEYWORD.match(text, at)
            if keyword is None or keyword[1] in arguments:
                return None
            try:
                arguments[keyword[1]], at = decoder.raw_decode(text, keyword.end())
            except ValueError:
                return None
            separator = SEPARATOR.match(text, at)
            at = separator.end()
            if not separator[1] and text[at] != ")":
                return None
        calls.append((name[1], arguments))
        separator = SEPARATOR.match(text, at + 1)
        at = separator.end()
        if at == len(text) - 1:
            return calls
        if not separator[1]:
            return None


def _python_valued(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of `text` read as a Python expression, its values literals, or None."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        try:
            json.dumps(arguments)
        except (TypeError, ValueError):  # a set, bytes, a complex number: not JSON arguments
            return None
        calls.append((node.func.id, arguments))
    return calls


def call_rules(i: int, name: str, schema: dict[str, Any]) -> list[str]:
    """The Lark rules of `call_<i>`, one pythonic call to `name`: its declared parameters as keywords in the
    order the schema lists them, the required ones always, each value JSON that matches its schema."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) and schema.get("additionalProperties") is False:
        properties = {}  # a closed object with no parameters: none
    if not isinstance(properties, dict):  # any object: any keywords, any JSON values
        return [f'call_{i}: {json.dumps(name + "(")} (kw_{i} ("," " " kw_{i})*)? ")"',
                f'kw_{i}: /[A-Za-z_][A-Za-z0-9_]*/ "=" v_{i}',
                f"v_{i}: %json {json.dumps({'x-guidance': LAYOUT})}"]
    names = list(properties)
    required = set(schema.get("required") or ()) & set(names)
    rules = []
    for j, key in enumerate(names):
        sub = properties[key] if isinstance(properties[key], dict) else {}
        rules.append(f"p_{i}_{j}: {json.dumps(key + '=')} v_{i}_{j}")
        rules.append(f"v_{i}_{j}: %json {json.dumps({**sub, 'x-guidance': LAYOUT})}")

    def nexts(start: int) -> list[int]:  # the parameters that may come next: any up to the first required one
        upto = next((j for j in range(start, len(names)) if names[j] in required), len(names) - 1)
        return list(range(start, upto + 1))

    def rest(start: int) -> str:  # what may follow once the parameters before `start` are settled
        if start == len(names):
            return ""
        return f"t_{i}_{start}" + ("" if required & set(names[start:]) else "?")

    for start in range(1, len(names)):
        rules.append(f"t_{i}_{start}: " + " | ".join(f'"," " " p_{i}_{j} {rest(j + 1)}' for j in nexts(start)))
    head = " | ".join(f"p_{i}_{j} {rest(j + 1)}" for j in nexts(0)) if names else ""
    if head:
        head = f"({head})" + ("" if required else "?")
    rules.append(f'call_{i}: {json.dumps(name + "(")} {head} ")"')
    return rules
