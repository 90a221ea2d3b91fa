"""Byte-level BPE: exact round trips for any UTF-8 text, and an EOS token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.runtime.tokenizer import EOS_TOKEN, Tokenizer

SAMPLES = [
    "",
    "Hello, world!",
    "Rom.\n  But soft!\tWhat light?\r\n",
    "emoji 🌍🎭👩‍👩‍👧‍👦 and flags 🇬🇧",
    "CJK 世界你好 こんにちは 안녕하세요",
    "control \x00\x01\x1b[0m and combining e\u0301",
    "   leading and trailing spaces   ",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_exact(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_round_trip_any_unicode(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_eos_is_a_special_token(tiny_tokenizer):
    assert tiny_tokenizer.eos_id == 0
    ids = tiny_tokenizer.encode("To be" + EOS_TOKEN)
    assert ids[-1] == tiny_tokenizer.eos_id
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "To be"


def test_learns_merges_from_the_corpus(tiny_tokenizer):
    # "tomorrow" is frequent in the training texts, so it costs far fewer tokens than bytes.
    assert len(tiny_tokenizer.encode("tomorrow")) < len("tomorrow") / 2


def test_save_and_load(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert loaded.vocab_size == tiny_tokenizer.vocab_size
    assert loaded.encode("Tomorrow, and tomorrow") == tiny_tokenizer.encode("Tomorrow, and tomorrow")


def test_eos_id_must_be_in_the_vocabulary(tiny_tokenizer):
    with pytest.raises(ValueError, match="outside"):
        Tokenizer(tiny_tokenizer.hf, eos_id=10**6)
