"""Training the byte-level BPE tokenizer that the default model uses (Hugging Face `tokenizers`).

The trained tokenizer is a `service.runtime.tokenizer.Tokenizer`, the class export and serving share.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from service.runtime.tokenizer import EOS_TOKEN


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> HFTokenizer:
    """Train a byte-level BPE whose id 0 is EOS_TOKEN."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
