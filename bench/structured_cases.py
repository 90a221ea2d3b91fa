"""The constraints `attnserve bench structured` measures and checks, the documents it walks, and the checks.

    from bench.structured_cases import CONSTRAINTS, documents, is_valid
    CONSTRAINTS["json_schema"]          # (grammar format, grammar text) as llguidance.grammar_from takes them
    documents(32, seed=0)               # 32 compact JSON texts that SCHEMA accepts, no two alike
    is_valid("regex", text)             # does the text satisfy that constraint?
    matches(text, SERVER_SCHEMA)        # is the text JSON that this schema accepts?

SCHEMA has 20 leaf fields (objects within objects, an array of objects, enums, required and optional fields,
integers and numbers with bounds, strings with patterns or a maxLength), every object closed
(`additionalProperties: false`), so that a walk that stops has written a whole document.

SERVER_SCHEMA is what the server part generates with the shipped model, whose context is 256 tokens: 8
leaf fields, all required, every one bounded (strings with a maxLength, integers with bounds, enums, a
boolean, an array with maxItems, a nested object), so that a document it accepts, written compactly, is at
most 125 tokens of the shipped tokenizer when its (at most 38) string characters are plain: 87 for the rest,
one per character (an escape such as `\\u00e9` takes up to six). No `number`: a JSON number's fraction has
no bound on its digits.
"""

from __future__ import annotations

import json
import random
import re

DATE = "20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def _closed(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


ADDRESS = _closed({"street": {"type": "string", "maxLength": 32}, "city": {"type": "string", "maxLength": 20},
                   "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                   "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}}, ["street", "city", "country"])
OWNER = _closed({"email": {"type": "string", "pattern": "^[a-z0-9._]{1,16}@[a-z0-9]{1,12}\\.(com|org|net)$"},
                 "role": {"enum": ["admin", "member", "guest"]}, "verified": {"type": "boolean"},
                 "address": ADDRESS}, ["email", "role", "address"])
ITEM = _closed({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "note": {"type": "string", "maxLength": 16}}, ["sku", "quantity", "price"])
TOTALS = _closed({"net": {"type": "number", "minimum": 0, "maximum": 1000000},
                  "tax": {"type": "number", "minimum": 0, "maximum": 1000},
                  "currency": {"enum": ["EUR", "USD", "GBP"]}}, ["net", "tax"])
SCHEMA = _closed({
    "id": {"type": "integer", "minimum": 1, "maximum": 999999},
    "name": {"type": "string", "maxLength": 24},
    "status": {"enum": ["draft", "open", "paid", "void"]},
    "created": {"type": "string", "pattern": f"^{DATE}$"},
    "priority": {"type": "integer", "minimum": 0, "maximum": 5},
    "owner": OWNER,
    "items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3},
    "totals": TOTALS,
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
}, ["id", "name", "status", "created", "owner", "items", "totals", "tags"])
SERVER_SCHEMA = _closed({
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "name": {"type": "string", "maxLength": 12},
    "status": {"enum": ["draft", "open", "paid", "void"]},
    "priority": {"type": "integer", "minimum": 0, "maximum": 5},
    "done": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    "owner": _closed({"city": {"type": "string", "maxLength": 10}, "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}},
                     ["city", "country"]),
}, ["id", "name", "status", "priority", "done", "tags", "owner"])
REGEX = f"{DATE} [A-Z][a-z]{{1,8}}( [A-Z][a-z]{{1,8}}){{0,2}}"
CHOICES = ["yes", "no", "maybe", "not applicable", "strongly agree", "strongly disagree"]
CONSTRAINTS = {  # kind: (llguidance.grammar_from format, text)
    "json_schema": ("json_schema", json.dumps(SCHEMA)),
    "regex": ("regex", REGEX),
    "choice": ("choice", json.dumps(CHOICES)),
}
# JSON as the engine constrains it by default: no whitespace between tokens, `,` and `:` as separators
JSON_OPTIONS = {"whitespace_flexible": False}


def leaf_fields(schema: dict = SCHEMA) -> int:
    """How many leaf fields a schema of objects and arrays has (SCHEMA: 20)."""
    if "properties" in schema:
        return sum(leaf_fields(s) for s in schema["properties"].values())
    if schema.get("type") == "array":
        return leaf_fields(schema["items"])
    return 1


def is_valid(kind: str, text: str) -> bool:
    """Does `text` satisfy the constraint of this kind in CONSTRAINTS?"""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return matches(text, SCHEMA)


def matches(text: str, schema: dict) -> bool:
    """Is `text` a JSON document that `schema` accepts?"""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` compact JSON documents SCHEMA accepts, keys in the schema's order (as the grammar writes them)."""
    rng = random.Random(seed)
    return [json.dumps(_document(rng, i), separators=(",", ":"), ensure_ascii=False) for i in range(n)]


def _document(rng: random.Random, i: int) -> dict:
    words = ["north", "harbour", "quarterly", "invoice", "garden", "supply", "river", "office", "Zürich", "café"]
    owner = {"email": f"{rng.choice(words[:8])}.{i}@example.{rng.choice(['com', 'org', 'net'])}",
             "role": rng.choice(["admin", "member", "guest"]), "verified": rng.random() < 0.5,
             "address": {"street": f"{rng.randint(1, 200)} {rng.choice(words).title()} Street",
                         "city": rng.choice(["Berlin", "Lyon", "Leeds", "Osaka", "Austin", "Zürich"]),
                         "postcode": f"{rng.randint(0, 99999):05d}",
                         "country": rng.choice(["DE", "FR", "GB", "US", "JP"])}}
    items = [{"sku": f"{rng.choice(['ABC', 'XYZ', 'QRS'])}-{rng.randint(0, 9999):04d}", "quantity": rng.randint(1, 100),
              "price": round(rng.uniform(0, 500), 2), "note": rng.choice(words)} for _ in range(rng.randint(1, 3))]
    net = round(sum(it["price"] * it["quantity"] for it in items), 2)
    return {"id": rng.randint(1, 999999), "name": f"{rng.choice(words).title()} order {i}",
            "status": rng.choice(["draft", "open", "paid", "void"]),
            "created": f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "priority": rng.randint(0, 5), "owner": owner, "items": items,
            "totals": {"net": net, "tax": round(min(net * 0.2, 1000), 2),
                       "currency": rng.choice(["EUR", "USD", "GBP"])},
            "tags": rng.sample(words[:8], rng.randint(0, 4))}
