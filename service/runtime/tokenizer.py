"""The bundle's tokenizer: `tokenizer.json`, read with Hugging Face `tokenizers`. No torch.

Byte-level means every UTF-8 string (emoji, CJK, control characters) encodes and decodes back
exactly: the base alphabet is all 256 bytes, so nothing is ever unknown. `<|endoftext|>` separates
documents and ends a generation.

Export writes it into the bundle and serving reads it from there: with the manifest, it is the
contract between the two (`model.training.tokenizer` trains it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

EOS_TOKEN = "<|endoftext|>"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with the ids the model needs."""

    def __init__(self, hf: HFTokenizer, eos_id: int | None = None):
        """eos_id defaults to the id of `<|endoftext|>`."""
        self.hf = hf
        if eos_id is None:
            eos_id = hf.token_to_id(EOS_TOKEN)
            if eos_id is None:
                raise ValueError(f"tokenizer has no end-of-sequence token {EOS_TOKEN!r}")
        elif hf.id_to_token(eos_id) is None:
            raise ValueError(f"eos id {eos_id} is outside the tokenizer's vocabulary")
        self.eos_id = eos_id

    @classmethod
    def from_file(cls, path: str | Path, eos_id: int | None = None) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(path)), eos_id)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids, as transformers' `tokenizer(text).input_ids` gives them: with the special tokens
        the tokenizer's post-processor adds (Llama's BOS; none for byte-level BPE like ours or GPT-2's),
        unless `add_special_tokens` is False (a rendered chat template carries its own).
        A literal special token in `text` (`<|endoftext|>`) maps to its id, as in `tokenizers`."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens, is_pretokenized=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, whole even where they are part of a UTF-8 character (which
        `decode([id])` turns into U+FFFD): byte-level BPE pieces mapped back through the byte alphabet,
        SentencePiece byte pieces (`<0xE2>`) as their byte and `▁` as a space, special tokens as their text."""
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        if self._decoding == "byte-level":
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif self._decoding == "sentencepiece":
            match = BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode()
        return self.decode([token_id]).encode()

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (`<|im_end|>`); an added token that is not is text."""
        return frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _decoding(self) -> str:
        """byte-level, sentencepiece (byte fallback) or other, from the tokenizer's decoder."""
        decoder = json.loads(self.hf.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        return "byte-level" if "ByteLevel" in kinds else "sentencepiece" if "ByteFallback" in kinds else "other"


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's alphabet: printable bytes stand for themselves, the others for the
    code points from 256 on, in byte order (GPT-2's table, which every byte-level tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table
