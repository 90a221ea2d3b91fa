"""Structured output: a request's `Constraint` compiled into a grammar by llguidance, one matcher per
sequence that follows its tokens, and the allowed-token masks of a batch.

    grammars = Grammars(tokenizer, vocab_size, eos_ids)
    grammar = grammars.compile(constraint)       # blocking, cached by content; InvalidRequest if it cannot compile
    matcher = grammar.matcher()                   # one per sequence (llguidance's LLMatcher)
    bitmask = grammars.masks([matcher, ...])      # [R, ceil(vocab / 32)] int32, one bit per token
    matcher.consume_token(token)                  # the sampled token; False if the grammar refuses it

llguidance compiles with bounded work (its parser limits) and releases the GIL while it compiles, so
compiles run beside the engine. EOS is in a mask only where the grammar may end. JSON has no free
whitespace between tokens unless the schema asks for it (`x-guidance`), so a weak model cannot spend
its tokens on blanks.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

from service.engine.errors import InvalidRequest
from service.engine.request import Constraint
from service.runtime.tokenizer import Tokenizer

CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped first
JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON, as OpenAI's structured outputs writes it
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar definition; raises InvalidRequest for malformed input."""
    kind, value = constraint.kind, constraint.value
    if kind == "choice":
        choices = _choices(value)
        return llguidance.grammar_from("choice", choices)
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        return llguidance.grammar_from("grammar", value)
    except (ValueError, TypeError) as e:
        raise InvalidRequest("constraint", f"the {kind.replace('_', ' ')} cannot be used: {_short(e)}") from None


def _choices(value: str) -> list[str]:
    try:
        choices = json.loads(value)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest("constraint", "a choice needs a non-empty list of non-empty strings")
    return choices


class Grammar:
    """A compiled constraint; every sequence under it gets its own matcher."""

    def __init__(self, constraint: Constraint, template: llguidance.LLMatcher):
        self.constraint = constraint
        self._template = template  # never advanced: only copied

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self._tokenizer_json = tokenizer.hf.to_str()
        self.vocab_size = vocab_size  # logits width: the mask has a bit for each
        self._eos = sorted(eos_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s at 150k tokens)
        self._unusable: str | None = None  # why llguidance cannot read the tokenizer, once it has tried
        self._cache: OrderedDict[Constraint, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per mask

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance reads it; InvalidRequest when it cannot (a tokenizer without a
        byte-level or SentencePiece decoder, such as a word-level one, has no bytes per token)."""
        with self._lock:
            if self._ll_tokenizer is None and self._unusable is None:
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                                eos_token=self._eos or None)
                except ValueError as e:
                    self._unusable = _short(e)
            if self._ll_tokenizer is None:
                raise InvalidRequest("constraint", "structured output is not available for this model: its "
                                     f"tokenizer cannot be read as bytes per token ({self._unusable})")
            return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> Grammar:
        """The constraint's grammar, from the cache or compiled now (blocking: call it off the engine
        thread). Raises InvalidRequest naming what does not compile."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        template = llguidance.LLMatcher(self.tokenizer(), grammar_text(constraint), log_level=0)
        if template.is_error():
            raise InvalidRequest("constraint", f"the {constraint.kind.replace('_', ' ')} does not compile: "
                                 f"{_short(template.get_error())}")
        grammar = Grammar(constraint, template)
        with self._lock:
            self._cache[constraint] = grammar
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def cached(self, constraint: Constraint) -> Grammar | None:
        """The constraint's grammar if it is compiled already (never blocks for long)."""
        with self._lock:
            grammar = self._cache.get(constraint)
            if grammar is not None:
                self._cache.move_to_end(constraint)
            return grammar

    def masks(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[R, words] int32 bit masks of `matchers`' next tokens, computed on the calling thread one row
        after another: on these machines neither a worker thread nor llguidance's parallel executor does
        better (docs/structured-output.md)."""
        bitmask = np.zeros((len(matchers), self.words), dtype=np.int32)
        address, row_bytes = bitmask.ctypes.data, self.words * 4  # rows are contiguous
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(address + i * row_bytes, row_bytes)
        return bitmask


def allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[R, words] int32 bit masks -> [R, vocab] of 0 and 1 (bit t of word t // 32 is token t)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)


def _short(error: object) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
