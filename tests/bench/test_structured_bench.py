"""`attnserve bench structured --part library` at a tiny size: real walks, real masks, checked text."""

from __future__ import annotations

import json
import random

import pytest

from bench.commands import structured
from bench.structured_cases import CONSTRAINTS, SCHEMA, documents, is_valid, leaf_fields
from bench.vocabularies import byte_level_bpe, sentencepiece_bpe
from tests.conftest import TINY_TEXTS

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def result():
    return structured.library_part(vocabs=(300,), sp_vocab=400, rounds=1, compiles=1, copies=2, batch=2, walks=3,
                                   budget=2000, texts=TINY_TEXTS)


def test_every_finished_walk_validates_on_both_tokenizer_kinds(result):
    correctness = result["correctness"]
    assert set(correctness) == {"byte-level 300", "sentencepiece 400"}
    for kinds in correctness.values():
        assert set(kinds) == set(CONSTRAINTS)
        for counts in kinds.values():
            assert counts["errors"] == 0 and counts["early_eos"] == 0
            assert counts["valid"] == counts["finished"]
            assert counts["finished"] + counts["budget"] == counts["walks"] == 3
        assert kinds["choice"]["finished"] == kinds["regex"]["finished"] == 3  # short: never near the budget


def test_the_result_has_every_timing_of_every_vocabulary(result, tmp_path):
    times = result["times_us"][300]
    assert set(times) == {"tokenizer", "compile", "first_mask", "deep_copy", "mask", "mask_batch"}
    assert times["mask"]["n"] >= 100  # a token of the document each
    assert all(t["median"] > 0 and t["p99"] >= t["median"] for t in times.values())
    assert result["schema_fields"] == 20 == leaf_fields(SCHEMA)
    text = structured.markdown({"machine": {"cpu": "test", "cores": 1, "cpu_flags": [], "python": "3",
                                            "onnxruntime": "1", "numpy": "2"}, "library": result}, "cmd")
    assert "| 300 |" in text and "| sentencepiece 400 |" in text


def test_the_checks_refuse_what_the_constraints_refuse():
    doc = json.loads(documents(1)[0])
    assert is_valid("json_schema", json.dumps(doc))
    doc["owner"]["address"]["country"] = "XX"
    assert not is_valid("json_schema", json.dumps(doc))
    assert is_valid("regex", "2026-11-25 Paris") and not is_valid("regex", "2026-13-25 Paris")
    assert is_valid("choice", "maybe") and not is_valid("choice", "may")


def test_a_walk_ends_where_the_matcher_stops_and_its_text_matches():
    tokenizer, _ = byte_level_bpe(300)
    lltok = structured.ll_tokenizer(tokenizer)
    m = structured.matcher(lltok, structured.grammar("choice"))
    tokens, end, early_eos = structured.walk(m, lltok, random.Random(0), budget=100)
    assert end in ("stopped", "eos") and early_eos == 0
    assert is_valid("choice", tokenizer.decode(tokens))


def test_the_sentencepiece_tokenizer_falls_back_to_bytes():
    tokenizer = sentencepiece_bpe(400, TINY_TEXTS)
    ids = tokenizer.encode("中", add_special_tokens=False)
    assert [tokenizer.hf.id_to_token(i) for i in ids][-3:] == ["<0xE4>", "<0xB8>", "<0xAD>"]
    assert tokenizer.decode(ids) == "中" and tokenizer.eos_id == 2
