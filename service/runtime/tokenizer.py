"""The bundle's tokenizer: `tokenizer.json`, read with Hugging Face `tokenizers`. No torch.

Byte-level means every UTF-8 string (emoji, CJK, control characters) encodes and decodes back
exactly: the base alphabet is all 256 bytes, so nothing is ever unknown. `<|endoftext|>` separates
documents and ends a generation.

Export writes it into the bundle and serving reads it from there: with the manifest, it is the
contract between the two (`model.tokenizer` trains it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

EOS_TOKEN = "<|endoftext|>"


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

    def encode(self, text: str) -> list[int]:
        """Text -> ids, as transformers' `tokenizer(text).input_ids` gives them: with the special tokens
        the tokenizer's post-processor adds (Llama's BOS; none for byte-level BPE like ours or GPT-2's).
        A literal special token in `text` (`<|endoftext|>`) maps to its id, as in `tokenizers`."""
        return self.hf.encode(text, add_special_tokens=True, is_pretokenized=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
