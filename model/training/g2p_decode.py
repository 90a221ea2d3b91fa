"""Greedy phonemes of words from a G2P model, and their scores against the references (WER, PER).

`attnserve train-g2p` scores its dev and test words with these; the model card shows a few words transcribed.
"""

from __future__ import annotations

import torch

from model.seq2seq import EncoderDecoder
from model.training import g2p_data as data
from model.training.g2p_data import PHONEMES, Pronunciation, Scores
from service.runtime.tokenizer import Tokenizer


def encode_words(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    return [tokenizer.encode(w) for w in words]


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def transcribe(model: EncoderDecoder, tokenizer: Tokenizer, words: list[str], batch_size: int = 512
               ) -> dict[str, Pronunciation]:
    """Greedy phonemes of each word (tokens after EOS, and non-phoneme tokens, dropped)."""
    pad_id = model.config.pad_token_id
    out: dict[str, Pronunciation] = {}
    order = sorted(range(len(words)), key=lambda i: len(words[i]))  # similar lengths batch with little padding
    model.eval()
    for at in range(0, len(order), batch_size):
        chunk = [words[i] for i in order[at:at + batch_size]]
        src = pad(encode_words(tokenizer, chunk), pad_id)
        for word, ids in zip(chunk, model.generate(src, (src != pad_id).long()), strict=True):
            tokens = [tokenizer.hf.id_to_token(i) for i in ids if i != model.config.eos_token_id]
            out[word] = tuple(t for t in tokens if t in PHONEMES)
    return out


def evaluate(model: EncoderDecoder, tokenizer: Tokenizer, words: dict[str, list[Pronunciation]]) -> Scores:
    return data.score(transcribe(model, tokenizer, list(words)), words)
