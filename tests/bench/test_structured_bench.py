"""`attnserve bench structured --part library` at a tiny size: real walks, real masks, checked text."""

from __future__ import annotations

import json
import random

import pytest

from bench.commands import structured
from bench.structured_cases import CONSTRAINTS, SCHEMA, SERVER_SCHEMA, documents, is_valid, leaf_fields, matches
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


# ---- --part server, at a tiny size: the engine in-process, 2 streams, one round, llama.cpp absent ----------


@pytest.fixture(scope="module")
def server_result():
    from bench.peers import llama_cpp
    from bench.structured_server import server_part
    from tests.conftest import SHIPPED_BUNDLE

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_cpp, "available", lambda: "llama.cpp not built (missing here on purpose)")
        return server_part(SHIPPED_BUNDLE, streams=2, singles=1, rounds=1, http=False, llama=True,
                           log=lambda line: None)


def test_the_server_part_constrains_every_completion_to_valid_json(server_result):
    counts = server_result["validity"]["attnserve in-process"]
    assert counts["total"] == 6  # warm-up and round: 1 alone + 2 together, twice
    assert counts["valid"] == counts["finished"] == counts["total"]
    assert set(server_result["validity"]) == {"attnserve in-process"}
    assert server_result["notes"] == ["llama.cpp skipped: llama.cpp not built (missing here on purpose)"]


def test_unconstrained_requests_generate_the_constrained_token_counts(server_result):
    rows = {row["streams"]: row for row in server_result["rows"]}
    assert set(rows) == {1, 2}
    for row in rows.values():
        samples = row["samples"]
        assert samples["constrained"][0]["tokens"] == samples["unconstrained"][0]["tokens"] \
            == sum(row["unconstrained_tokens"])
        assert row["constrained_tokens_per_s"] > 0 and row["unconstrained_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["constrained_tokens_per_s"] / row["unconstrained_tokens_per_s"])


def test_the_mask_clock_saw_every_constrained_token(server_result):
    rows = {row["streams"]: row for row in server_result["rows"]}
    for level, masks in server_result["masks"].items():
        tokens = rows[int(level)]["samples"]["constrained"][0]["tokens"]
        assert masks["tokens"] == tokens  # one mask row per sampled token
        assert masks["calls"] > 0 and masks["mask_us_per_token"] > 0
    assert set(server_result["compile"]["attnserve in-process"]) == {"cold", "cold_first_mask", "cached",
                                                                    "cached_first_mask"}


def test_the_mask_clock_counts_rows_and_leaves_the_grammars_as_they_were():
    from bench.structured_load import MaskClock

    class Grammars:
        def masks(self, matchers):
            return [m * 2 for m in matchers]

    grammars = Grammars()
    with MaskClock(grammars) as clock:
        assert grammars.masks([1, 2, 3]) == [2, 4, 6] and grammars.masks([4]) == [8]
    assert "masks" not in vars(grammars)
    summary = clock.summary()
    assert summary["tokens"] == 4 and summary["calls"] == 2 and summary["rows_per_call"] == 2


def test_the_server_section_says_whether_the_target_was_met(server_result):
    from bench.structured_server import server_markdown

    text = "\n".join(server_markdown(server_result, "cmd", "test machine"))
    assert "| attnserve in-process | 2 |" in text and "| attnserve in-process | 1 |" in text
    assert ("**met**" in text) != ("**missed**" in text)
    assert "llama.cpp skipped: llama.cpp not built" in text
    assert "| 2 | constrained |" in text and "| 1 | unconstrained |" in text


def test_the_step_clock_times_both_modes_and_only_masks_the_constrained(server_result):
    steps = server_result["steps"]
    assert set(steps) == {"1 constrained", "1 unconstrained", "2 constrained", "2 unconstrained"}
    rows = {row["streams"]: row for row in server_result["rows"]}
    for key, c in steps.items():
        level, mode = key.split(" ")
        assert c["tokens"] == rows[int(level)]["samples"][mode][0]["tokens"]
        u = c["us_per_token"]
        assert set(u) == {"run_prefill", "run_decode", "masks_of", "sample", "update"}
        assert c["wall_us_per_token"] >= sum(u.values())  # the parts run one after another inside the runs


def test_every_compile_probe_schema_is_new():
    from bench.structured_server import variant

    texts = {json.dumps(SERVER_SCHEMA)} | {json.dumps(variant(k)) for k in range(5)}
    assert len(texts) == 6  # the engine's cache is keyed by the text: none of them is a hit
    doc = '{"id":1,"name":"","status":"open","priority":0,"done":true,"tags":[],"owner":{"city":"","country":"DE"}}'
    assert matches(doc, SERVER_SCHEMA) and matches(doc, variant(3)) and not matches(doc.replace("DE", "XX"), variant(3))
