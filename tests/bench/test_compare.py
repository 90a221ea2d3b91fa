"""`attnserve bench compare`: its table and verdicts on synthetic results, the peer protocol, and a quick run."""

from __future__ import annotations

import json
import math
import sys

import pytest

from bench.commands import compare
from bench.commands.compare import (
    agreement,
    alone_equals_batched,
    evaluate,
    make_spec,
    render,
    rotated,
    summarize_system,
)
from bench.peers import protocol, systems
from bench.peers.systems import SYSTEMS, System, select


def result(tps1: float, tps32: float, tokens=None, ttft=0.01, rss=100 * 2**20, single_tokens=None) -> dict:
    """One round's result; the batch-1 ids default to the first three streams' (a batch-invariant system)."""
    if single_tokens is None and tokens is not None:
        single_tokens = tokens[:3]
    return {"single": {"tokens_per_s": [tps1], "ttft_s": [ttft]},
            "streams": {"n": 32, "tokens_per_s": [tps32], "ttft_p50_s": [ttft * 5], "ttft_p99_s": [ttft * 6]},
            "tokens": tokens, "single_tokens": single_tokens, "peak_rss_bytes": rss, "settings": {"threads": 2},
            "versions": {"x": "1"}}


REF = [[1, 2, 3, 4]] * 32


def row(family: str, precision: str, tps1: float, tps32: float, tokens=REF, size: str = "gpt2-124m") -> dict:
    system = next(s for s in SYSTEMS if s.family == family and s.precision == precision)
    return summarize_system(system, size, [result(tps1, tps32, tokens)], REF)


def test_agreement_counts_exact_rows_and_the_mean_common_prefix():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    a = agreement(got, ref)
    assert a["exact_rows"] == 1 and a["rows"] == 3
    assert a["mean_prefix"] == pytest.approx((4 + 2 + 0) / 3)
    assert agreement(None, ref)["exact_rows"] is None  # a system without ids (batched-bench)


def test_every_system_gets_the_same_prompts_and_token_count():
    spec = make_spec(4096, 16, 128, 3, seed=0)
    assert spec == make_spec(4096, 16, 128, 3, seed=0)
    assert len(spec["single"]) == 3 and len(spec["streams"]) == 32 and spec["new_tokens"] == 128
    assert all(len(p) == 16 and all(1 <= t < 4096 for t in p) for p in spec["streams"])
    assert spec["streams"] == [i.prompt for i in compare.workload.fixed(32, 16, 128, 4096, 0)]
    assert len({tuple(p) for p in spec["streams"]}) == 32  # distinct prompts, so a row is one prompt's


def test_the_batch_1_prompts_are_the_first_streams_so_each_runs_alone_and_among_32():
    spec = make_spec(4096, 16, 128, 4, seed=1)
    assert spec["single"] == spec["streams"][:4]
    assert make_spec(4096, 16, 128, 32, seed=1)["single"] == spec["streams"]
    for singles in (0, 33):
        with pytest.raises(ValueError, match="first of the 32 streams"):
            make_spec(4096, 16, 128, singles, seed=1)


def test_alone_equals_batched_counts_the_batch_1_prompts_with_the_same_ids_among_32():
    streams = [[i, i + 1, i + 2] for i in range(32)]
    assert alone_equals_batched(streams[:4], streams) == 4
    assert alone_equals_batched([[0, 1, 2], [1, 2, 9], [2, 3, 4]], streams) == 2  # one token off is a miss
    assert alone_equals_batched([[1, 2, 3]], streams) == 0  # compared with its own row (the first), not any row
    assert alone_equals_batched(None, streams) is None and alone_equals_batched(streams[:1], None) is None
    with pytest.raises(ValueError):  # more batch-1 results than prompts: not this spec's
        alone_equals_batched(streams + [[0]], streams)


def test_a_row_shows_how_many_batch_1_prompts_got_their_ids_among_32():
    tokens = [[i, 0, 0, 0] for i in range(32)]
    drifted = summarize_system(System("transformers", "fp32", "transformers"), "gpt2-124m",
                               [result(10, 100, tokens, single_tokens=[tokens[0], [1, 0, 0, 7], tokens[2]])], REF)
    assert (drifted["alone_equals_batched"], drifted["alone_prompts"]) == (2, 3)
    no_ids = summarize_system(System("llama.cpp-batched", "q8_0", "llama.cpp batched-bench"), "gpt2-124m",
                              [result(10, 100)], REF)
    assert no_ids["alone_equals_batched"] is None and no_ids["alone_prompts"] is None
    lines = compare.table([drifted, no_ids])
    assert "alone = among 32" in lines[0] and lines[0].count("|") == lines[1].count("|")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 2/3 |" in lines[2] and "| — |" in lines[3]


def test_rounds_rotate_the_order_so_every_system_takes_each_place():
    order = ["a", "b", "c"]
    assert [rotated(order, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                      ["a", "b", "c"]]


def test_systems_are_selected_by_key_or_family():
    assert [s.key for s in select("ctranslate2", "")] == ["ctranslate2:fp32", "ctranslate2:int8"]
    assert all(s.family != "llama.cpp-batched" for s in select("", "llama.cpp-batched,openvino:int8"))
    assert "openvino:int8" not in {s.key for s in select("", "openvino:int8")}
    with pytest.raises(ValueError, match="unknown systems"):
        select("tensorrt", "")


def test_a_row_is_the_median_over_rounds():
    system = System("ctranslate2", "int8", "CTranslate2")
    rounds = [result(10, 100, REF), result(30, 300, REF), result(20, 200, REF, rss=300 * 2**20)]
    r = summarize_system(system, "shipped", rounds, REF)
    assert r["single_tokens_per_s"] == 20 and r["streams_tokens_per_s"] == 200
    assert r["peak_rss_bytes"] == 300 * 2**20  # the largest of the rounds
    assert r["exact_rows"] == 32 and r["tokens_same_every_round"] is True
    assert (r["alone_equals_batched"], r["alone_prompts"]) == (3, 3)


def test_targets_per_size_and_precision_class():
    rows = [row("transformers", "fp32", 100, 400), row("ctranslate2", "fp32", 200, 1000),
            row("llama.cpp", "q8_0", 300, 1200, tokens=[[1, 2, 0, 0]] * 32),
            row("ctranslate2", "int8", 250, 2000, tokens=[[1, 2, 3, 0]] * 32),
            row("attnserve-grpc", "fp32", 230, 1600), row("attnserve-grpc", "int8", 320, 2500, tokens=[[1, 2, 0, 4]] * 32),
            row("attnserve", "int8", 400, 2600)]
    rows[-1]["bound_tokens_per_s"] = 450
    t = {(x["class"], x["target"].split(" ≥")[0]): x for x in evaluate(rows)}
    fp32_streams = t[("fp32", "32 gRPC streams")]
    assert fp32_streams["ratio"] == pytest.approx(1.6) and fp32_streams["met"] is True
    assert fp32_streams["peer"] == "CTranslate2 fp32"
    assert t[("fp32", "batch 1 over gRPC")]["ratio"] == pytest.approx(1.15) and t[("fp32", "batch 1 over gRPC")]["met"]
    eight_streams = t[("8-bit", "32 gRPC streams")]  # q8_0 and int8 are one class: the best of them
    assert eight_streams["peer"] == "CTranslate2 int8" and eight_streams["ratio"] == pytest.approx(1.25)
    assert eight_streams["met"] is False
    assert t[("8-bit", "batch 1 over gRPC")]["peer"] == "llama.cpp server q8_0"
    # agreement against the class's fastest peer at 32 streams (CTranslate2 int8: 0 rows, prefix 3)
    assert t[("8-bit", "greedy agreement with fp32 transformers")]["met"] is False
    assert t[("fp32", "greedy agreement with fp32 transformers")]["met"] is True
    bound = t[("8-bit", "batch 1")]
    assert bound["ratio"] == pytest.approx(400 / 450) and bound["met"] is True
    assert ("4-bit", "32 gRPC streams") not in t  # neither side measured: no verdict at all


def test_the_per_tensor_int8_graph_is_shown_but_is_neither_ours_nor_a_peer_in_a_target():
    rows = [row("ctranslate2", "int8", 250, 2000), row("attnserve-grpc", "int8", 320, 2500),
            row("attnserve-grpc", "int8-per-tensor", 9000, 90000, tokens=[[9, 9, 9, 9]] * 32),
            row("attnserve", "int8-per-tensor", 9000, 90000)]
    assert "int8-per-tensor" in compare.CLASSES["8-bit"] and compare.OURS["8-bit"] == "int8"
    assert [r["key"] for r in compare.class_peers(rows, "gpt2-124m", "8-bit")] == ["ctranslate2:int8"]
    t = {x["target"].split(" ≥")[0]: x for x in evaluate(rows) if x["class"] == "8-bit"}
    assert t["32 gRPC streams"]["ours"] == 2500 and t["32 gRPC streams"]["peer"] == "CTranslate2 int8"
    assert t["greedy agreement with fp32 transformers"]["ours"] == (32, 4)
    assert System("attnserve-grpc", "int8-per-tensor", "attnserve gRPC").graph == "static-int8-per-tensor"
    assert {s.key for s in select("attnserve", "")} >= {"attnserve:int8", "attnserve:int8-per-tensor"}


def test_a_side_not_measured_gives_no_verdict():
    verdicts = evaluate([row("llama.cpp", "q4_0", 100, 500)])
    assert verdicts and all(v["met"] is None for v in verdicts)
    assert all(math.isnan(v["ratio"]) for v in verdicts)


def test_the_report_names_every_system_target_and_skip(tmp_path):
    from bench.machine import describe

    rows = [row("transformers", "fp32", 100, 400), row("attnserve-grpc", "fp32", 230, 1600)]
    r = {"machine": describe(), "sizes": [{"size": "gpt2-124m", "arch": "gpt", "parameters": 124e6,
                                           "vocab_size": 50257, "n_ctx": 1024, "prompt_tokens": 16, "new_tokens": 4,
                                           "singles": 3, "streams": 32, "seconds": 60}],
         "repeats": 1, "read_gb_per_s": 39.0, "rows": rows, "notes": ["gpt2-124m: openvino:fp32 skipped: missing"],
         "targets": evaluate(rows)}
    md = render(json.loads(json.dumps(r)), ["--quick"])
    assert "| transformers | fp32 |" in md and "| **attnserve gRPC** | fp32 |" in md
    assert "32 gRPC streams ≥ 1.5× the best peer" in md and "openvino:fp32 skipped: missing" in md
    from bench.plots import compare_plot

    assert compare_plot(r, tmp_path).is_file()


def test_the_protocol_checks_token_counts_and_precisions():
    spec = {"new_tokens": 2, "single": [[1]], "streams": [[1]] * 32, "repeats": 2}
    rec = protocol.Recorder(spec)
    with pytest.raises(RuntimeError, match="no batch-1 repeat"):
        rec.result("x", "int8", {}, {}, [[1, 2]] * 32, peak_rss=1)
    rec.add_single([0.5], [0.1], [[3, 4]])
    rec.add_single([0.5], [0.1], [[5, 6]])  # a later repeat's ids are not kept
    rec.add_streams(2.0, [0.1] * 32)
    out = rec.result("x", "int8-per-tensor", {}, {}, [[1, 2]] * 32, peak_rss=1)
    assert out["single"]["tokens_per_s"] == [4.0, 4.0] and out["streams"]["tokens_per_s"] == [32.0]
    assert out["single_tokens"] == [[3, 4]]
    with pytest.raises(RuntimeError, match="expected 32 rows of 2"):
        rec.result("x", "int8", {}, {}, [[1]] * 32, peak_rss=1)
    with pytest.raises(ValueError, match="precision"):
        rec.result("x", "bf16", {}, {}, [[1, 2]] * 32, peak_rss=1)
    short = protocol.Recorder(spec)
    short.add_single([0.5], [0.1], [[3]])
    with pytest.raises(RuntimeError, match=r"\(batch 1\) returned \[1\] tokens per row, expected 1 rows of 2"):
        short.result("x", "int8", {}, {}, [[1, 2]] * 32, peak_rss=1)
    assert protocol.peak_rss_bytes() > 0


@pytest.mark.slow
def test_a_quick_run_measures_attnserve_and_skips_a_missing_peer_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(systems.VENVS, "ctranslate2", tmp_path / "no-such-venv")
    out = tmp_path / "out"
    argv = ["--quick", "--sizes", "gpt2-124m", "--systems", "transformers,ctranslate2,attnserve,attnserve-grpc:fp32",
            "--skip", "attnserve:int4", "--work", str(tmp_path / "work"), "--bandwidth-gbps", "20", "--out", str(out)]
    assert compare.main(argv) == 0
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if line.startswith("  ctranslate2:")]  # the progress log
    assert len(skipped) == 2 and all("no-such-venv is missing (make bench-peers)" in s for s in skipped)
    r = json.loads((out / "compare.json").read_text())
    keys = {row["key"]: row for row in r["rows"]}
    assert set(keys) == {"transformers:fp32", "attnserve:fp32", "attnserve:int8", "attnserve:int8-per-tensor",
                         "attnserve-grpc:fp32"}
    assert keys["transformers:fp32"]["exact_rows"] == 32  # the reference agrees with itself
    # the fp32 graph reproduces fp32 transformers' greedy ids, in-process and over gRPC
    assert keys["attnserve:fp32"]["exact_rows"] == 32 and keys["attnserve-grpc:fp32"]["exact_rows"] == 32
    # every system's batch-1 prompt was compared with its own row among the 32; attnserve's graphs but the
    # per-tensor one are batch-invariant, so there it is the same
    assert all(row["alone_prompts"] == 1 and row["alone_equals_batched"] in (0, 1) for row in r["rows"])
    assert all(keys[k]["alone_equals_batched"] == 1 for k in ("attnserve:fp32", "attnserve:int8",
                                                                "attnserve-grpc:fp32"))
    assert all(row["peak_rss_bytes"] > 0 and row["streams_tokens_per_s"] > 0 for row in r["rows"])
    assert (out / "compare.png").is_file()


def test_a_failing_system_says_why_in_the_first_line_of_its_error():
    with pytest.raises(RuntimeError) as failed:
        systems.run([sys.executable, "-c", "import sys; print('noise', file=sys.stderr); sys.exit('the reason')"],
                    SYSTEMS[0])
    assert str(failed.value).splitlines()[0] == "exit status 1: the reason"
