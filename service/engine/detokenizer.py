"""Token ids -> text deltas, one token at a time, with stop strings matched across token boundaries.

A tokenizer splits a multi-byte character across tokens (byte-level BPE, or SentencePiece's
`<0xE2>`-style byte-fallback pieces), so decoding one token alone can give a broken fragment.
`IncrementalDetokenizer` (the prefix/read offsets of vLLM's detokenizer) decodes a short window
and emits text only once it no longer ends in an incomplete character.
Window boundaries fall only after complete characters, where UTF-8 decoding restarts cleanly, so
the concatenated deltas equal decoding all the ids at once. For byte-level BPE (GPT-2 style, the
default) `ByteDetokenizer` does the same with a table of each token's bytes and Python's
incremental UTF-8 decoder, without calling the tokenizer per token.

`TextStream` adds stop strings: text that might be the start of a stop string is held back, and
when one matches, the text before it is emitted and the stop string itself is not.
"""

from __future__ import annotations

import codecs
import functools

from tokenizers import decoders

from service.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE tokens are made of)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer: Tokenizer) -> tuple[bytes, ...] | None:
    """Each id's bytes for a byte-level BPE tokenizer (special tokens: none); None for other tokenizers."""
    hf = tokenizer.hf
    if not isinstance(hf.decoder, decoders.ByteLevel):
        return None
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    added = hf.get_added_tokens_decoder()
    table = []
    for i in range(hf.get_vocab_size()):
        if i in added:
            table.append(b"" if added[i].special else added[i].content.encode())
            continue
        token = hf.id_to_token(i)
        if token is None or any(c not in char_to_byte for c in token):
            return None
        table.append(bytes(char_to_byte[c] for c in token))
    return tuple(table)


class ByteDetokenizer:
    """The fast path for byte-level BPE: token bytes through an incremental UTF-8 decoder."""

    def __init__(self, table: tuple[bytes, ...]):
        self.table = table
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        return self.decoder.decode(self.table[token_id])

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


@functools.lru_cache(maxsize=8)
def byte_pieces(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback pieces (`<0x00>` ... `<0xFF>`), which carry one raw byte each."""
    hf = tokenizer.hf
    ids = (hf.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


def make_detokenizer(tokenizer: Tokenizer) -> ByteDetokenizer | IncrementalDetokenizer:
    table = token_bytes(tokenizer)
    return ByteDetokenizer(table) if table is not None else IncrementalDetokenizer(tokenizer)


class IncrementalDetokenizer:
    """Any tokenizer: decode a short window of ids, emit only text that ends in a complete character.

    A run of byte-fallback pieces is held back whole until a token that is not one ends it: the
    tokenizer's ByteFallback decoder turns a run into text all or nothing (an invalid run, complete
    characters and all, becomes one U+FFFD per byte), so only the whole run decodes as
    `tokenizer.decode` of the whole completion does."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pieces = byte_pieces(tokenizer)
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this have been turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if token_id in self.pieces:
            return ""  # inside a run of byte pieces: its text depends on the whole run
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""  # an incomplete character: wait for the next token

    def flush(self) -> str:
        """Whatever is left at the end of the sequence, broken characters included (as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]


class TextStream:
    """One sequence's text: deltas safe to send, stop strings cut out."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self.detok = make_detokenizer(tokenizer)
        self.stop = list(stop or [])
        self.text = ""  # decoded so far (held-back text included)
        self.sent = 0  # characters of `text` already emitted

    def push(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether a stop string matched)."""
        new = self.detok.add(token_id)
        if not self.stop:  # the common case: nothing to hold back
            return new, False
        self.text += new
        return self._emit(check_stop)

    def finish(self, check_stop: bool = True) -> tuple[str, bool]:
        """The sequence ended: flush everything still held (unless a stop string cuts it)."""
        if not self.stop:
            return self.detok.flush(), False
        self.text += self.detok.flush()
        return self._emit(check_stop, final=True)

    def _emit(self, check_stop: bool, final: bool = False) -> tuple[str, bool]:
        if check_stop and self.stop:
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                delta, self.text, self.sent = self.text[self.sent:end], self.text[:end], end
                return delta, True
        end = len(self.text) if final or not check_stop else len(self.text) - self._held()
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta, False

    def _held(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        unsent = len(self.text) - self.sent
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, unsent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
