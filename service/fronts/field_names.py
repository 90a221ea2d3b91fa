"""The engine's field names as each front spells them.

Every rule about a request is written once and names fields as the engine does: `sampling.temperature`,
`stopping.max_new_tokens`, `beam.width`, `prompt_token_ids[3]`, `constraint`, and a map's entry by its key
(`sampling.logit_bias.50256`). A front whose protocol spells a field otherwise holds a `FieldNames`, engine
name -> its own, and turns every `InvalidRequest` into its own terms before the client sees it, so that an
error names only fields the client's protocol has:

    GRPC_NAMES = FieldNames({"beam.width": "beam_width", ...})     # constant: the proto never changes
    names = openai_names(...)                                       # HTTP: one per request, built once
    raise names.renamed(error)

A field the table leaves out is spelt as the engine spells it. In a message, a field mentioned by its last
name (`max_new_tokens` in "prompt 4 tokens + max_new_tokens 256 exceed ...") is renamed too when that name
is an identifier (it holds an underscore); plain words such as `width` are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from service.engine.errors import InvalidRequest

_INDEX = re.compile(r"(\[\d+\])+$")


@dataclass(frozen=True)
class FieldNames:
    """How one front spells the engine's fields."""

    spelling: Mapping[str, str] = field(default_factory=dict)  # engine field (no item index) -> the front's
    keep_index: bool = True  # name an item (`stopping.stop[1]`); False names its list alone (`stop`)

    def name(self, engine_field: str) -> str:
        """`engine_field` (`stopping.stop[1]`; a map's entry by its key, `sampling.logit_bias.50256`) as the
        front spells it."""
        index = _INDEX.search(engine_field)
        base = engine_field[:index.start()] if index else engine_field
        owner, _, key = base.rpartition(".")
        if base not in self.spelling and key.isdigit() and owner in self.spelling:
            return f"{self.spelling[owner]}.{key}"
        return self.spelling.get(base, base) + (index.group() if index and self.keep_index else "")

    def renamed(self, error: InvalidRequest) -> InvalidRequest:
        """`error` in the front's terms: its field, and the fields its message mentions."""
        message = str(error).removeprefix(error.field + ": ")
        for engine_field, front in self.spelling.items():
            last, own = engine_field.rsplit(".", 1)[-1], front.rsplit(".", 1)[-1]
            if "_" in last and last != own:
                message = re.sub(rf"(?<![\w.]){re.escape(last)}(?!\w)", own, message)
        return InvalidRequest(self.name(error.field), message)
