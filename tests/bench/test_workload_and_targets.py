"""The benchmark workloads: the same prompts for every system (the comparison's verdicts: test_compare.py)."""

from __future__ import annotations

from bench import workload


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
