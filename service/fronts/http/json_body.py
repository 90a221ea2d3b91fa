"""Request bodies as JSON, at a cost bounded before any of it becomes Python objects.

    data = await parse(raw)      # InvalidRequest for JSON that is malformed, nests too deep or holds too much

Building Python objects is what a large body costs, and the parser holds the interpreter while it
does: 4 MiB of `[1],[1],...` is a million lists and about 0.4 s during which both fronts would stand
still. So a body's arrays and objects (MAX_CONTAINERS) and its values (MAX_VALUES) are counted first,
on the bytes at C speed, and a body over either limit is refused before it is parsed. Brackets and
commas inside strings do not count: when the quick count is over a limit, the exact one (which skips
strings) decides. Nesting deeper than MAX_DEPTH is refused, so that no later step (validation, the chat
template) recurses without bound. Bodies larger than OFF_LOOP_BYTES are parsed in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from service.engine.errors import InvalidRequest

MAX_CONTAINERS = 16384  # JSON arrays and objects in one body
MAX_VALUES = 262144  # array items and object members in one body
MAX_DEPTH = 64  # nesting of arrays and objects
OFF_LOOP_BYTES = 64 * 1024

QUOTE, BACKSLASH, COMMA, OPEN_ARRAY, OPEN_OBJECT = 34, 92, 44, 91, 123


async def parse(raw: bytes, hint: str = "") -> Any:
    """`raw` as JSON within MAX_CONTAINERS, MAX_VALUES and MAX_DEPTH; raises InvalidRequest (param `body`),
    with `hint` after the message of a body that holds too much (what the endpoint's lists may hold)."""
    if len(raw) <= OFF_LOOP_BYTES:
        return _parse(raw, hint)
    return await asyncio.to_thread(_parse, raw, hint)


def _parse(raw: bytes, hint: str) -> Any:
    containers, values = raw.count(b"[") + raw.count(b"{"), raw.count(b",")  # upper bounds, at memchr speed
    if containers > MAX_CONTAINERS or values > MAX_VALUES:
        containers, values = count_outside_strings(raw)
        if containers > MAX_CONTAINERS:
            raise InvalidRequest("body", f"holds {containers} JSON arrays and objects; a request may hold at most "
                                 f"{MAX_CONTAINERS}{hint}")
        if values > MAX_VALUES:
            raise InvalidRequest("body", f"holds about {values} JSON values; a request may hold at most {MAX_VALUES}"
                                 f"{hint}")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest("body", f"is not valid JSON: {e}") from None
    if containers > MAX_DEPTH and depth(data) > MAX_DEPTH:
        raise _too_deep()
    return data


def _too_deep() -> InvalidRequest:
    return InvalidRequest("body", f"nests arrays and objects more than {MAX_DEPTH} deep")


def count_outside_strings(raw: bytes) -> tuple[int, int]:
    """(arrays and objects, values) in `raw`, counting only what is outside strings: opening brackets, and
    commas plus one. Linear, in numpy: a quote counts unless an odd number of backslashes precedes it,
    and a string runs from a counting quote to the next."""
    b = np.frombuffer(raw, np.uint8)
    quotes = np.flatnonzero(b == QUOTE)
    backslashes = np.flatnonzero(b == BACKSLASH)
    if backslashes.size and quotes.size:
        # the start of each run of consecutive backslashes, for every backslash
        starts = np.maximum.accumulate(np.where(np.diff(backslashes, prepend=-2) != 1, backslashes, 0))
        at = np.searchsorted(backslashes, quotes - 1)
        hit = at < backslashes.size
        hit[hit] = backslashes[at[hit]] == quotes[hit] - 1
        run = np.zeros(quotes.size, np.int64)
        run[hit] = quotes[hit] - starts[at[hit]]  # backslashes right before the quote
        quotes = quotes[run % 2 == 0]
    opening, closing = quotes[0::2], np.append(quotes[1::2], b.size - 1)[:(quotes.size + 1) // 2]
    return _outside(b == OPEN_ARRAY, opening, closing) + _outside(b == OPEN_OBJECT, opening, closing), \
        _outside(b == COMMA, opening, closing) + 1

def depth(data: Any) -> int:
    """How deep arrays and objects nest in parsed JSON (a scalar: 0)."""
    deepest, level = 0, [(data, 1)]
    while level:
        value, d = level.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        level.extend((child, d + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _outside(mask: np.ndarray, opening: np.ndarray, closing: np.ndarray) -> int:
    """How many of `mask`'s bytes lie outside the strings [opening[i], closing[i]]."""
    at = np.flatnonzero(mask)
    return int(at.size - (np.searchsorted(at, closing) - np.searchsorted(at, opening)).sum())
