"""Tokenizers of real vocabulary sizes and of both kinds attnserve serves, built from local text (no downloads).

    from bench.vocabularies import byte_level_bpe, sentencepiece_bpe, local_texts
    gpt2_size, trained = byte_level_bpe(50257)  # a service.runtime.tokenizer.Tokenizer, ids BPE training gave
    llama2_style = sentencepiece_bpe(32000)

- `byte_level_bpe(n)`: GPT-2 / Llama-3 / Qwen2 style (ByteLevel pre-tokenizer and decoder, `<|endoftext|>` = 0).
  At the shipped tokenizer's size or below it is the shipped BPE's first `n` ids (`bench.sizes.truncated_bpe`).
  Above, a BPE trained on `local_texts()`; when training runs out of merges before `n` ids, the vocabulary is
  extended with synthetic merges: two tokens of the vocabulary joined, the second not starting a word, as BPE
  merges join them, chosen by a seeded generator. So every id is a real, decodable byte-level token.
- `sentencepiece_bpe(n)`: Llama-2 style: BPE with `byte_fallback`, the 256 `<0x..>` byte pieces in the
  vocabulary (not special), `▁` metaspace, `<unk>` `<s>` `</s>` = 0 1 2, `</s>` ends a generation.
- `local_texts()`: the Shakespeare plays of the training corpus and the Python standard library's sources
  (English prose and code, as a model's vocabulary covers).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from service.runtime.tokenizer import Tokenizer

SEED = 0
STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SP_SPECIAL = ["<unk>", "<s>", "</s>"]
SP_EOS_ID = 2
METASPACE = "\u2581"
CODE_CHARS = 40_000_000  # more than the standard library holds (31.5M characters in Python 3.11): all of it


def local_texts(max_code_chars: int = CODE_CHARS) -> list[str]:
    """The Shakespeare plays, then standard-library sources in path order up to `max_code_chars`."""
    from model.training.data import load_plays

    texts = list(load_plays().values())
    total = 0
    for path in sorted(STDLIB.rglob("*.py")):
        if "site-packages" in path.parts or total >= max_code_chars:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    return texts


def byte_level_bpe(vocab_size: int, texts: Sequence[str] | None = None) -> tuple[Tokenizer, int]:
    """A byte-level BPE of exactly `vocab_size` ids (see the module docstring), and how many of its ids
    training gave (the shipped BPE's included); the others are synthetic merges."""
    from tokenizers import Tokenizer as HFTokenizer

    from bench.sizes import SHIPPED_MODEL, truncated_bpe
    from model.training.tokenizer import train_bpe

    shipped = HFTokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json"))
    if vocab_size <= shipped.get_vocab_size():
        return Tokenizer(truncated_bpe(shipped, vocab_size)), vocab_size
    trained = train_bpe(texts if texts is not None else local_texts(), vocab_size=vocab_size, min_frequency=2)
    return Tokenizer(with_synthetic_merges(trained, vocab_size)), trained.get_vocab_size()


def with_synthetic_merges(hf, vocab_size: int, seed: int = SEED):
    """`hf` (a trained BPE with no added tokens past its special ones) grown to `vocab_size` ids by merges of two
    of its tokens, the second one a word's continuation (no leading space `Ġ`)."""
    from tokenizers import Tokenizer as HFTokenizer

    data = json.loads(hf.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    special = {t["content"] for t in data["added_tokens"]}
    pieces = [t for t in vocab if t not in special]
    continuations = [t for t in pieces if not t.startswith("Ġ")]
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        left, right = rng.choice(pieces), rng.choice(continuations)
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append([left, right])
            pieces.append(left + right)
    return HFTokenizer.from_str(json.dumps(data))


def sentencepiece_bpe(vocab_size: int, texts: Sequence[str] | None = None) -> Tokenizer:
    """A Llama-2 style BPE with byte fallback of at most `vocab_size` ids (fewer when the text runs out of
    merges), `</s>` its end of sequence (see the module docstring)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="first")
    hf.decoder = decoders.Sequence([decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SP_SPECIAL + byte_pieces,
                                  limit_alphabet=1000, show_progress=False)
    hf.train_from_iterator(texts if texts is not None else local_texts(), trainer=trainer)
    data = json.loads(hf.to_str())
    # the byte pieces are ordinary pieces of the vocabulary, as in Llama-2's tokenizer.json, not special tokens
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in SP_SPECIAL]
    return Tokenizer(HFTokenizer.from_str(json.dumps(data)), eos_id=SP_EOS_ID)
