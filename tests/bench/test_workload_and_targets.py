"""The benchmark workloads (same prompts for every system) and the comparison's verdicts."""

from __future__ import annotations

import math

import pytest

from bench import workload
from bench.compare import TARGETS, evaluate, prompts_for, ttft_check


def test_fixed_workload_is_seeded_and_in_range():
    a = workload.fixed(10, 16, 128, vocab=4096, seed=3)
    assert a == workload.fixed(10, 16, 128, vocab=4096, seed=3)
    assert a != workload.fixed(10, 16, 128, vocab=4096, seed=4)
    assert all(len(i.prompt) == 16 and i.new_tokens == 128 for i in a)
    assert all(1 <= t < 4096 for i in a for t in i.prompt)


def test_mixed_workload_ranges_and_context_clipping():
    items = workload.mixed(500, vocab=4096, context=10_000, seed=0)
    lengths = [len(i.prompt) for i in items]
    news = [i.new_tokens for i in items]
    assert min(lengths) >= 8 and max(lengths) <= 512 and max(lengths) > 400 and min(lengths) < 50
    assert min(news) >= 16 and max(news) <= 256 and max(news) > 230
    short = workload.mixed(500, vocab=4096, context=256, seed=0)
    assert all(len(i.prompt) + i.new_tokens <= 256 and len(i.prompt) >= 8 for i in short)
    assert [i.new_tokens for i in short] == [min(n, 256 - 8) for n in news]  # the same draw, clipped


def test_batches_deal_round_robin():
    items = workload.fixed(7, 4, 8, vocab=100, seed=0)
    plan = workload.batches(items, 3)
    assert [len(p) for p in plan] == [3, 2, 2]
    assert plan[0] == [items[0], items[3], items[6]]


def test_every_system_gets_the_same_prompts():
    assert prompts_for(8, 16, 4096, seed=0) == prompts_for(8, 16, 4096, seed=0)
    assert len(prompts_for(32, 16, 4096, seed=0)) == 32


def rows(values: dict[tuple[str, int], float]) -> list[dict]:
    return [{"system": s, "batch": b, "tokens_per_s": v} for (s, b), v in values.items()]


def test_targets_are_ratios_of_medians():
    r = rows({("transformers", 1): 200, ("optimum", 1): 400, ("attnserve in-process", 1): 900,
              ("attnserve gRPC", 1): 700, ("transformers", 32): 2000, ("optimum", 32): 1500,
              ("attnserve in-process", 32): 6000, ("attnserve gRPC", 32): 5000})
    verdicts = {t["target"]: t for t in evaluate(r)}
    assert len(verdicts) == len(TARGETS)
    b1_hf = verdicts["batch 1: attnserve in-process ≥ 3× HF generate"]
    assert b1_hf["ratio"] == pytest.approx(4.5) and b1_hf["met"] is True
    assert verdicts["batch 1: attnserve over gRPC ≥ 2× optimum"]["met"] is False  # 1.75×
    assert verdicts["32 gRPC streams ≥ 3× optimum at batch 32"]["ratio"] == pytest.approx(5000 / 1500)
    assert verdicts["32 gRPC streams ≥ 0.85× the engine in-process"]["met"] is False  # 0.83×


def test_a_peer_not_measured_gives_no_verdict():
    verdicts = evaluate(rows({("attnserve gRPC", 1): 700, ("transformers", 1): 200}))
    missing = [t for t in verdicts if "optimum" in t["target"]]
    assert missing and all(math.isnan(t["ratio"]) and t["met"] is None for t in missing)


def test_ttft_check_compares_loaded_p99_with_idle_p50():
    latency = {1: [{"ttft_s": {"p50": 0.004, "p99": 0.006}}, {"ttft_s": {"p50": 0.006, "p99": 0.008}}],
               32: [{"ttft_s": {"p50": 0.01, "p99": 0.014}}, {"ttft_s": {"p50": 0.01, "p99": 0.016}}]}
    t = ttft_check(latency)
    assert t["streams"] == 32 and t["idle_ttft_p50_s"] == pytest.approx(0.005)
    assert t["loaded_ttft_p99_s"] == pytest.approx(0.015) and t["ratio"] == pytest.approx(3.0) and t["met"]
    latency[32][0]["ttft_s"]["p99"] = 0.02
    assert not ttft_check(latency)["met"]
    assert ttft_check({32: latency[32]}) is None
