"""What a field of a request schema takes, in plain words, and where a JSON value departs from it, so that
a value of the wrong type is answered with the type its field declares, derived from the annotations.

    wrong = wrong_type(ChatCompletionRequest, {"top_p": "0.9", ...})
    # WrongType(path="top_p", expected="a number", value="0.9")

The words are JSON's, as the client writes a value: `str` is "a string", `int` "an integer", `float` "a
number" (it takes integers too, so `int | float` is "a number"), `bool` "a boolean", a model or a `dict`
"an object", `list[X]` "an array of" X in the plural, `Any` "any JSON value", and a `Literal` its values
quoted ("one of 'text', 'json_object', 'json_schema'"). A union lists its members ("a string or an array
of strings"), `None` left out: null leaves an optional field unset.

A value departs from a type where no member of the type has the value's JSON type. Where members do, it
is followed inside them (items, an object's fields): when one member takes it whole there is no departure;
when only one member has its JSON type, the departure is the one inside that member (`["a", 3]` given to
`str | list[str]` departs at `[1]`, "a string"); when several have it, the departure is the union's, which
is named whole (an array of floats given to a prompt is none of the prompt's kinds of array).
"""

from __future__ import annotations

import functools
import json
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

# a Python type -> the types of the JSON values it takes (as json.loads makes them), its name (one, several)
JSON_TYPES: dict[Any, tuple[tuple[type, ...], str, str]] = {
    str: ((str,), "a string", "strings"), int: ((int,), "an integer", "integers"),
    float: ((int, float), "a number", "numbers"), bool: ((bool,), "a boolean", "booleans"),
    dict: ((dict,), "an object", "objects"), list: ((list,), "an array", "arrays"),
    type(None): ((type(None),), "null", "nulls"),
}
EVERY_TYPE = frozenset(t for taken, _, _ in JSON_TYPES.values() for t in taken)


@dataclass(frozen=True)
class WrongType:
    """A value that no member of its field's type takes."""

    path: str  # where, as the client spells it: `messages[0].content`, `response_format.json_schema.schema`
    expected: str  # what the schema takes there, in words: "a number", "a string or an array of strings"
    value: Any  # what the client sent there


def wrong_type(schema: type[BaseModel], data: Any) -> WrongType | None:
    """Where `data`, a body for `schema`, first has a value of a JSON type its field does not take (fields
    in the schema's order, an empty path for a body that is no object); None if its types are right
    throughout (a range, a length or a field's presence is what is wrong)."""
    return _departure(_shape(schema), data, "")


def describe(annotation: Any, plural: bool = False) -> str:
    """The values `annotation` takes, in words: "a number", "'none', 'auto', 'required' or an object"."""
    members = [m for m in _members(annotation) if m is not type(None)]
    if float in members:  # a number takes integers
        members = [m for m in members if m is not int]
    nouns = [noun for m in members for noun in _nouns(m, plural)]
    if len(nouns) > 1 and all(_kind(m) is Literal for m in members):
        return "one of " + ", ".join(nouns)
    return nouns[-1] if len(nouns) == 1 else ", ".join(nouns[:-1]) + " or " + nouns[-1]


def _nouns(member: Any, plural: bool) -> list[str]:
    kind = _kind(member)
    if kind is Literal:
        return [f"'{v}'" if isinstance(v, str) else json.dumps(v) for v in get_args(member)]
    if kind not in JSON_TYPES:
        return ["JSON values" if plural else "any JSON value"]
    noun = JSON_TYPES[kind][2 if plural else 1]
    if kind is list and get_args(member):
        return [f"{noun} of {describe(get_args(member)[0], plural=True)}"]
    return [noun]


@dataclass(frozen=True)
class _Member:
    """A member of a type's union, as the walk reads it (built once per annotation)."""

    kind: Any  # the Python type of its values (`dict` for a model, `list` for list[int]), Literal, or Any
    types: tuple[type, ...] | None  # the types of the JSON values of its kind; None: any, or a literal's
    values: tuple[Any, ...]  # a Literal's values
    items: _Shape | None  # the type of a list's items or a dict's values
    model: type[BaseModel] | None  # a model, whose fields are walked

    def takes(self, value: Any) -> bool:
        """Whether `value` has this member's JSON type, its items and fields aside (the exact type: a
        boolean is no number)."""
        if self.kind is Literal:
            return any(type(value) is type(v) and value == v for v in self.values)
        return self.types is None or type(value) in self.types


@dataclass(frozen=True)
class _Shape:
    """A type as the walk reads it: what it takes without a look, then its members."""

    annotation: Any
    whole: frozenset[type]  # the types of the values it takes whole (its scalars'; every type for Any)
    members: tuple[_Member, ...]


def _departure(shape: _Shape, value: Any, path: str) -> WrongType | None:
    if type(value) in shape.whole:
        return None
    fitting = [m for m in shape.members if m.takes(value)]
    inside = [_inside(m, value, path) for m in fitting]
    if fitting and None in inside:
        return None
    if len(fitting) == 1:
        return inside[0]
    return WrongType(path, describe(shape.annotation), value)


def _inside(member: _Member, value: Any, path: str) -> WrongType | None:
    """The first departure within `value`, whose own JSON type is `member`'s: in its items or fields. The
    values a type takes whole are passed over without a call (a long array of numbers, say)."""
    items = member.items
    if member.model is not None:
        parts = ((shape, value[key], f"{path}.{key}" if path else key) for key, shape in _fields(member.model).items()
                 if key in value and type(value[key]) not in shape.whole)
    elif member.kind is list and items is not None:
        parts = ((items, item, f"{path}[{i}]") for i, item in enumerate(value) if type(item) not in items.whole)
    elif member.kind is dict and items is not None:
        parts = ((items, item, f"{path}.{key}") for key, item in value.items() if type(item) not in items.whole)
    else:
        return None
    return next(filter(None, (_departure(*part) for part in parts)), None)


@functools.cache
def _shape(annotation: Any) -> _Shape:
    """`annotation` read for the walk, once: a model's fields are read when a value of it is walked."""
    members, whole = [], set()
    for member in _members(annotation):
        kind, args = _kind(member), get_args(member)
        taken = JSON_TYPES[kind][0] if kind in JSON_TYPES else None
        if kind not in (list, dict, Literal):
            whole.update(taken or EVERY_TYPE)
        items = _shape(args[-1]) if kind in (list, dict) and args else None
        members.append(_Member(kind, taken, args if kind is Literal else (), items,
                               member if _is_model(member) else None))
    return _Shape(annotation, frozenset(whole), tuple(members))


def _members(annotation: Any) -> list[Any]:
    """A union's members, unions within it flattened; `Annotated` (StrictInt, ...) read as its type."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


def _kind(member: Any) -> Any:
    """The Python type of a union member's values: `dict` for a model, `list` for `list[int]`, `Literal`
    for a literal."""
    return dict if _is_model(member) else get_origin(member) or member


def _is_model(member: Any) -> bool:
    return isinstance(member, type) and issubclass(member, BaseModel)


@functools.cache
def _fields(model: type[BaseModel]) -> dict[str, _Shape]:
    """A model's fields as the client may spell them (by alias, and by name where the model allows it),
    each with its type, in the model's order."""
    by_name = model.model_config.get("populate_by_name", False)
    fields: dict[str, _Shape] = {}
    for name, info in model.model_fields.items():
        for key in (info.alias, name if by_name or not info.alias else None):
            if key:
                fields[key] = _shape(info.annotation)
    return fields
