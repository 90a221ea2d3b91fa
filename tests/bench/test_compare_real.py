"""`attnserve bench compare --real-shapes`: its rates, rules, targets and report on made-up runs, and a quick run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.commands import compare_real
from bench.commands.compare_real import System, all_systems, select
from bench.real_report import (
    REAL_POINTS,
    all_decoding,
    decode_rate,
    evaluate,
    fastest_precision,
    mixed_summary,
    nearest,
    render,
    slow_precisions,
    summarize,
)
from bench.real_runs import Plan, batched_bench_command


def run(shape: str, key: str, family: str, prefill=None, decode=None, rnd: int = 1, label: str | None = None,
        **extra) -> dict:
    return {"shape": shape, "key": key, "family": family, "label": label or key, "round": rnd,
            "prefill": prefill or {}, "prefill_server": {}, "decode": decode or {}, "mixed": None,
            "peak_rss_bytes": 10**9, "settings": {"command": "x"}, **extra}


# ---- the decode rate ------------------------------------------------------------------------------------------


def test_one_stream_decodes_its_tokens_after_the_first_over_first_to_last():
    arrivals = [(10.0, 1), (10.5, 1), (11.0, 2), (12.0, 1)]  # 5 tokens, the third message carries 2
    assert decode_rate([arrivals]) == pytest.approx(4 / 2.0)


def test_streams_count_the_tokens_inside_the_window_where_all_decode():
    a = [(0.0, 1), (1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]
    b = [(1.5, 1), (2.5, 1), (3.5, 1), (5.0, 1)]  # starts last (1.5); a ends first (4.0)
    # in (1.5, 4.0]: a at 2, 3, 4 and b at 2.5, 3.5
    assert decode_rate([a, b]) == pytest.approx(5 / 2.5) and all_decoding([a, b])


def test_streams_that_never_decode_together_fall_back_to_the_sum_of_their_own_rates():
    a = [(0.0, 1), (1.0, 1), (2.0, 1)]
    b = [(3.0, 1), (4.0, 1), (7.0, 1)]
    assert decode_rate([a, b]) == pytest.approx(2 / 2.0 + 2 / 4.0) and not all_decoding([a, b])
    assert math.isnan(decode_rate([[(1.0, 4)]]))  # everything in one message: no rate
    assert math.isnan(decode_rate([]))


def test_the_mixed_load_gives_ttft_percentiles_and_the_wall_time():
    out = mixed_summary([0.0, 1.0, 2.0], [0.5, 2.0, None], [3.0, 4.0, 6.0])
    assert out["requests"] == 3 and out["answered"] == 2
    assert out["ttft_p50_s"] == pytest.approx(0.75) and out["ttft_p99_s"] == pytest.approx(0.995)
    assert out["total_s"] == 6.0


# ---- the rules ------------------------------------------------------------------------------------------------


def test_a_precision_below_80_percent_at_every_measure_is_left_out():
    first = {"f16": {"prefill": {"512": 100.0}, "decode": {"512": {"1": 10.0, "8": 50.0}}},
             "q8_0": {"prefill": {"512": 70.0}, "decode": {"512": {"1": 15.0, "8": 60.0}}},
             "q4_0": {"prefill": {"512": 75.0}, "decode": {"512": {"1": 11.0, "8": 47.0}}}}
    slow = slow_precisions(first)
    assert set(slow) == {"q4_0"} and "78%" in slow["q4_0"]  # its best share: 47 / 60
    first["q4_0"]["decode"]["512"]["1"] = 12.1  # 81% of the best at one measure: kept
    assert slow_precisions(first) == {}
    assert slow_precisions({}) == {}


def test_the_longest_prefill_and_the_server_take_the_precision_fastest_at_the_target():
    first = {"f16": {"prefill": {"4000": 100.0}}, "q8_0": {"prefill": {"4000": 130.0}},
             "q4_0": {"prefill": {"512": 999.0}}}
    assert fastest_precision(first, 4000) == "q8_0"
    assert fastest_precision(first, 16000) is None


def test_targets_are_read_at_the_point_asked_or_the_nearest_measured():
    assert nearest([512, 4000, 16000], 4000) == 4000
    assert nearest([16, 32], 4000) == 32 and nearest([8000], 512) == 8000 and nearest([1, 2], 8) == 2
    assert nearest([], 8) is None


def test_rounds_rotate_and_systems_are_selected_by_key_or_family():
    systems = all_systems(["static-int8", "static-int4"])
    keys = [s.key for s in systems]
    assert keys.index("llama.cpp-batched:q4_0") < keys.index("llama.cpp-server")  # the server learns from them
    assert [s.key for s in compare_real.rotated(systems, 1)][0] == "attnserve:static-int4"
    assert [s.key for s in select(systems, "attnserve", "")] == ["attnserve:static-int8", "attnserve:static-int4"]
    assert "llama.cpp-batched:f16" not in {s.key for s in select(systems, "", "llama.cpp-batched:f16")}
    with pytest.raises(ValueError, match="unknown systems"):
        select(systems, "vllm", "")
    assert System("llama.cpp-batched:q8_0", "llama.cpp-batched", "q8_0").label == "llama.cpp batched-bench q8_0"


def test_batched_bench_holds_a_shared_prompt_once():
    shared = batched_bench_command(Path("/b"), Path("m.gguf"), 2, 8000, 64, (1, 8, 32),
                                   shared=True)
    text = " ".join(shared)
    assert "-npl 1,8,32,1" in text and "-pps --kv-unified" in text and "-fa on" in text
    assert shared[shared.index("-c") + 1] == str(8000 + 32 * 64 + 16)
    alone = batched_bench_command(Path("/b"), Path("m.gguf"), 2, 4000, 1, (1,),
                                  shared=False)
    assert "-pps" not in alone and alone[alone.index("-c") + 1] == str(4000 + 1 + 16)


def test_a_plan_sizes_contexts_by_its_longest_sequence_and_what_is_in_flight():
    from bench.workload import Item

    plan = Plan((512, 4000), (512, 8000), (1, 8), 64, (Item([1] * 300, 64), Item([1] * 100, 64)), 1.0, 100, 0)
    assert plan.longest() == 8064
    assert plan.most_in_flight() == 8 * 8064
    assert plan.prompt(512, 1) == plan.prompt(512, 1) != plan.prompt(512, 2)
    assert len(plan.prompt(512, 1)) == 512 and all(1 <= t < 100 for t in plan.prompt(512, 1))


# ---- over rounds, targets, the report ---------------------------------------------------------------------------


def fake_runs() -> list[dict]:
    runs = []
    for rnd, scale in ((1, 1.0), (2, 1.2), (3, 0.9)):
        runs += [run("qwen2.5-0.5b", "attnserve:static-int8", "attnserve", {"4000": 130 * scale},
                     {"512": {"1": 40 * scale, "8": 200 * scale}}, rnd, "attnserve gRPC static-int8",
                     weight_bytes_per_token=5 * 10**8),
                 run("qwen2.5-0.5b", "attnserve-default", "attnserve-default", {"4000": 90 * scale},
                     {"512": {"1": 30 * scale, "8": 90 * scale}}, rnd, "attnserve out of the box",
                     graph="static-int8" if rnd < 3 else "static-int4"),
                 run("qwen2.5-0.5b", "llama.cpp-batched:q4_0", "llama.cpp-batched", {"4000": 100 * scale},
                     {"512": {"1": 25 * scale, "8": 120 * scale}}, rnd, "llama.cpp batched-bench q4_0"),
                 run("qwen2.5-0.5b", "llama.cpp-server", "llama.cpp-server", {"4000": 110 * scale},
                     {"512": {"1": 20 * scale}}, rnd, "llama.cpp server q4_0")]
    runs[-3]["decode_apart"] = ["512x8"]  # out of the box, round 3
    return runs


def test_a_row_is_the_median_over_rounds():
    rows = {r["key"]: r for r in summarize(fake_runs())}
    ours = rows["attnserve:static-int8"]
    assert ours["rounds"] == 3 and ours["prefill"] == {"4000": pytest.approx(130)}
    assert ours["decode"]["512"]["8"] == pytest.approx(200)
    assert rows["attnserve-default"]["graph"] == "static-int8, static-int4"  # every graph it picked
    assert rows["llama.cpp-server"]["decode"]["512"] == {"1": pytest.approx(20)}


def test_targets_set_attnserve_against_llama_cpps_best_of_any_precision_or_front():
    targets = evaluate(summarize(fake_runs()), REAL_POINTS, [512, 4000], [512], [1, 8])
    by = {(t["target"].split(" ≥")[0], t["ours"]): t for t in targets}
    prefill = by[("prefill at 4000 tokens", "attnserve gRPC static-int8")]
    assert prefill["peer"] == "llama.cpp server q4_0" and prefill["ratio"] == pytest.approx(130 / 110)
    assert prefill["met"] is False  # 1.18 < 1.2
    one = by[("decode, batch 1, after 512", "attnserve gRPC static-int8")]
    assert one["peer"] == "llama.cpp batched-bench q4_0" and one["ratio"] == pytest.approx(1.6) and one["met"]
    eight = by[("decode, 8 streams, after 512", "attnserve out of the box")]
    assert eight["ratio"] == pytest.approx(90 / 120) and eight["met"] is False
    alone = evaluate(summarize([r for r in fake_runs() if r["family"] == "attnserve"]), REAL_POINTS, [4000], [512],
                     [1, 8])
    assert alone and all(t["met"] is None for t in alone)  # nothing to compare with: no verdict


def test_the_report_has_every_table_and_the_rules(tmp_path):
    from bench.machine import describe

    rows = summarize(fake_runs())
    result = {"machine": describe(), "repeats": 3, "read_gb_per_s": 20.0, "bandwidth_after": 512,
              "plan": {"prefill": [512, 4000], "decode_after": [512], "batches": [1, 8], "new_tokens": 64,
                       "mixed": {"requests": 16, "lo": 200, "hi": 4000, "new_tokens": 64, "interval_s": 1.0}},
              "shapes": [{"shape": "qwen2.5-0.5b", "architecture": "Qwen2ForCausalLM", "parameters": 494e6}],
              "rows": rows, "targets": evaluate(rows, REAL_POINTS, [512, 4000], [512], [1, 8]),
              "notes": ["qwen2.5-0.5b: llama.cpp batched-bench f16 left out after round 1"], "rules": ["a rule"]}
    md = render(json.loads(json.dumps(result)), ["--repeats", "3"])
    assert md.startswith("## attnserve against llama.cpp at real shapes\n")
    assert "`attnserve bench compare --real-shapes --repeats 3`" in md
    assert "| **attnserve gRPC static-int8** | — | 130 |" in md  # 512 not measured, 4000 measured
    assert "after 512, 8 streams" in md and "| llama.cpp server q4_0 | 20.0 | — |" in md
    assert "| **attnserve out of the box** | 30.0 | 90.0* |" in md and "never all decoded at once" in md
    assert "| **attnserve gRPC static-int8** | — | — | — | 1000 | 500.0 | 40.0 | 20.0 | 100% |" in md
    assert "decode, batch 1, after 512 ≥ 1.5×" in md and "f16 left out after round 1" in md and "- a rule" in md
    tables = [line for line in md.splitlines() if line.startswith("|")]
    assert all(line.count("|") >= 3 for line in tables)


@pytest.mark.slow
def test_a_quick_run_measures_every_system_it_can(tmp_path, capsys):
    work = tmp_path / "work"
    assert compare_real.main(["--quick", "--no-write", "--work", str(work), "--bandwidth-gbps", "20"]) == 0
    printed = capsys.readouterr().out
    assert "## attnserve against llama.cpp at real shapes" in printed
    result = json.loads((work / "compare-real.json").read_text())
    keys = {r["key"]: r for r in result["rows"]}
    assert {"attnserve:static-int8", "attnserve:static-int4", "attnserve-default"} <= set(keys)
    assert keys["attnserve-default"]["graph"]  # the graph it picked, as ModelInfo names it
    for key in ("attnserve:static-int8", "attnserve-default"):
        row = keys[key]
        assert set(row["prefill"]) == {"16", "32"} and row["prefill"]["16"] > 0
        assert row["mixed"]["ttft_p50_s"] > 0 and row["peak_rss_bytes"] > 0 and row["weight_bytes_per_token"] > 0
    llama_skipped = any("llama.cpp skipped" in n for n in result["notes"])
    assert llama_skipped or {"llama.cpp-batched:q4_0", "llama.cpp-server"} <= set(keys)
    assert result["targets"] and result["complete"] is True


def test_a_failure_is_one_line_with_the_end_of_the_log_it_quotes():
    e = RuntimeError("attnserve exited with 1 while starting; the end of its log (x.log):\nloading\n"
                     "start-up failed: inputs do not match\n")
    assert compare_real.failure(e) == ("attnserve exited with 1 while starting; the end of its log (x.log): … "
                                       "start-up failed: inputs do not match")
    assert compare_real.failure(ValueError()) == "ValueError"
