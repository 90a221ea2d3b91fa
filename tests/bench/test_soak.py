"""The soak's verdict on synthetic samples: flat memory passes, a leak or an error fails."""

from __future__ import annotations

import pytest

from bench.commands.soak import WARM_UP_S, verdict


def samples(rss_at, seconds=600, step=5):
    return [{"t": float(t), "rss": rss_at(t), "tokens_per_s": 1000.0 + (t % 7), "requests_per_s": 5.0, "errors": 0}
            for t in range(step, seconds + 1, step)]


def test_flat_memory_after_warm_up_passes_even_if_warm_up_grew():
    mib = 2**20
    v = verdict(samples(lambda t: (200 if t <= WARM_UP_S else 300) * mib + (t % 3) * mib), {})
    assert v["rss_flat"] and v["no_errors"]
    assert v["rss_median_bytes"] == pytest.approx(301 * 2**20, rel=0.01)
    assert v["rss_max_deviation"] < 0.01
    assert v["tokens_per_s_min"] >= 1000 and v["tokens_per_s_max"] <= 1006


def test_a_steady_leak_fails():
    v = verdict(samples(lambda t: 300 * 2**20 + t * 200_000), {})  # +115 MB over ten minutes
    assert not v["rss_flat"] and v["rss_max_deviation"] > 0.10


def test_any_error_fails():
    v = verdict(samples(lambda t: 300 * 2**20), {"UNAVAILABLE": 1})
    assert v["rss_flat"] and not v["no_errors"] and v["errors"] == 1
