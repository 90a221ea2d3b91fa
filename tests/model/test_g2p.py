"""The G2P data (CMUdict, its split, its tokenizer), the scores, and a short training run end to end."""

from __future__ import annotations

import pytest

from model.training import g2p_data as data
from model.training.g2p_data import Scores, edit_distance, g2p_tokenizer, score

pytestmark = pytest.mark.needs_torch("the G2P tools are training tools")


@pytest.fixture(scope="module")
def words():
    return data.load_cmudict()


def test_the_dictionary_is_read_without_stress(words):
    assert len(words) > 120_000
    assert words["transformer"] == [("T", "R", "AE", "N", "S", "F", "AO", "R", "M", "ER")]
    assert len(words["either"]) >= 2  # alternates (either(1)) join their word
    assert all(p in data.PHONEMES for prons in words.values() for pron in prons for p in pron)
    assert all(data.WORD.match(w) for w in words)


def test_the_split_is_by_word_disjoint_and_stable(words):
    split = data.split_words(words)
    sides = [set(split.train), set(split.dev), set(split.test)]
    assert sum(map(len, sides)) == len(words) and not (sides[0] & sides[2]) and not (sides[1] & sides[2])
    assert 0.04 < len(split.test) / len(words) < 0.06 and 0.005 < len(split.dev) / len(words) < 0.015
    assert data.split_words(dict(reversed(list(words.items())))).test.keys() == split.test.keys()


def test_the_tokenizer_reads_letters_and_writes_phonemes():
    tok = g2p_tokenizer()
    ids = tok.encode("Cat's")
    assert [tok.hf.id_to_token(i) for i in ids] == ["c", "a", "t", "'", "s"]
    assert tok.hf.id_to_token(tok.encode("é")[0]) == data.UNK
    phones = [tok.hf.token_to_id(p) for p in ("K", "AE", "T")]
    assert tok.decode(phones) == "K AE T" and tok.eos_id == tok.hf.token_to_id(data.EOS)


def test_scores_count_any_reference_and_the_closest_edits():
    assert edit_distance(("K", "AE", "T"), ("K", "AH", "T", "S")) == 2
    refs = {"a": [("AH",), ("EY",)], "cat": [("K", "AE", "T")], "the": [("DH", "AH"), ("DH", "IY")]}
    got = score({"a": ("EY",), "cat": ("K", "AH", "T"), "the": ("DH",)}, refs)
    # "a" matches its second reference; "cat" is one edit from 3 phonemes; "the" one edit from either (2)
    assert got == Scores(words=3, wer=2 / 3, per=(0 + 1 + 1) / (1 + 3 + 2))


@pytest.mark.slow
def test_a_short_training_run_writes_a_scored_servable_model(short_g2p_run, tmp_path):
    from export.seq2seq_bundle import export_seq2seq_bundle

    out, log = short_g2p_run
    assert log["result"]["test_words"] == 50 and 0 <= log["result"]["test_per"] and log["result"]["test_wer"] <= 1
    assert [h["step"] for h in log["history"]] == [3, 6]
    card = (out / "README.md").read_text()
    assert "Yolchuyeva" in card and "attnserve train-g2p --out" in card
    export_seq2seq_bundle(out, tmp_path / "bundle")
