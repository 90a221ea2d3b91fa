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
ANSWER_GRAMMAR = "answer"  # the name of the constrained part's grammar after a lead


def grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar definition; raises InvalidRequest for malformed input."""
    answer = _answer_text(constraint)
    return _after_lead(constraint.lead, answer) if constraint.lead else answer


def _after_lead(lead: str, answer: str) -> str:
    """A grammar of the text `lead`'s rule `lead` matches, then `answer`'s: the answer is a grammar of its own
    (llguidance's `@name` reference), so it keeps its lexer and options (JSON's whitespace)."""
    grammars = json.loads(answer)["grammars"] if answer.lstrip().startswith("{") else [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": ANSWER_GRAMMAR}
    start = {"name": "lead", "lark_grammar": f"start: lead @{ANSWER_GRAMMAR}\n{lead}"}
    return json.dumps({"grammars": [start, *grammars]})


def _answer_text(constraint: Constraint) -> str:
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
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits width: the mask has a bit for each
        self._eos = sorted(eos_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built at warm-up: it reads every token's bytes
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
                    self._ll_tokenizer = _vocabulary(self._tokenizer, self.vocab_size, self._eos)
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


class _TextTokenizer:
    """The vocabulary as llguidance's `TokenizerWrapper` reads it: every id's bytes, the special ids, and a
    tokenize for the text a grammar forces that never yields a special token."""

    def __init__(self, read: llguidance.LLTokenizer, tokens: list[bytes], special: frozenset[int], eos: Sequence[int]):
        self._read = read
        self._special = special
        self.tokens = tokens
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        ids = self._read.tokenize_str(text)  # the tokenizer's own split (SentencePiece's prefix space handled)
        if self._special.isdisjoint(ids):
            return ids
        # text that spells a special token ("<|im_end|>" inside a JSON string) is written in ordinary tokens
        return self._read.greedy_tokenize(text)


def _vocabulary(tokenizer: Tokenizer, vocab_size: int, eos: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary, with the same tokens allowed by the mask and by the matcher.

    Read from tokenizer.json alone, llguidance takes every added token for a special one, a token no grammar
    can write, yet the tokenizer it uses for the text a grammar forces spells `<tool_call>` with Qwen2.5's
    added token: the mask then offers that token and the matcher refuses it. Here an added token that is not
    special is the text it stands for, as transformers decodes it; a special token, and every id past the
    tokenizer's (a padded vocabulary), is special, and so never allowed inside a constraint (EOS only where
    the grammar may end)."""
    read = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size)  # bytes per token, for any layout
    known = tokenizer.vocab_size
    special = tokenizer.special_ids | set(range(known, vocab_size))
    tokens = [b"" if i >= known else read.decode_bytes([i]) for i in range(vocab_size)]
    wrapper = llguidance.TokenizerWrapper(_TextTokenizer(read, tokens, special, eos))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos) or None)


def allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[R, words] int32 bit masks -> [R, vocab] of 0 and 1 (bit t of word t // 32 is token t)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)


def _short(error: object) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
