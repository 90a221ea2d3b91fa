"""The load generator's accounting on synthetic records: percentiles, latencies, throughput windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.stats import RequestRecord, percentile, steady_window, summarize


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy_linear_interpolation(n):
    values = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([5.0, 1.0, 3.0], 0) == 1.0  # unsorted input
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def record(sent, arrivals, client=0, code="OK", expected=None):
    r = RequestRecord(sent, client=client, code=code, expected_tokens=expected)
    for t, n in arrivals:
        r.arrived(t, n)
    return r


def test_one_request_latencies():
    # sent at 10.0; a token-less message, then 1 token at 10.5, 2 at 10.7, 1 at 11.0
    r = record(10.0, [(10.1, 0), (10.5, 1), (10.7, 2), (11.0, 1)], expected=4)
    assert r.tokens == 4
    assert r.ttft == pytest.approx(0.5)
    assert r.itls() == pytest.approx([0.2, 0.3])  # one gap per message carrying tokens
    assert r.tpot == pytest.approx(0.5 / 3)  # (last token - first token) / (tokens - 1)
    assert r.e2e == pytest.approx(1.0)


def test_failed_request_without_tokens():
    r = record(1.0, [], code="DEADLINE_EXCEEDED")
    assert r.ttft is None and r.tpot is None and r.itls() == [] and r.e2e == 0.0 and not r.ok


def test_summary_counts_tokens_requests_and_errors():
    records = [record(0.0, [(0.1 * k, 1) for k in range(1, 11)], client=0, expected=10),
               record(0.0, [(0.2 * k, 1) for k in range(1, 6)], client=1, expected=5),
               record(0.5, [(0.6, 1)], client=1, code="RESOURCE_EXHAUSTED"),
               record(0.5, [(0.7, 1), (0.8, 1)], client=1, expected=3)]  # came back short
    s = summarize(records)
    assert (s.requests, s.ok, s.errors, s.short) == (4, 3, {"RESOURCE_EXHAUSTED": 1}, 1)
    assert s.tokens == 10 + 5 + 2  # the failed request's token does not count
    assert s.duration_s == pytest.approx(1.0)
    assert s.overall_tokens_per_s == pytest.approx(17.0)
    assert s.overall_requests_per_s == pytest.approx(3.0)
    assert s.ttft_s["p50"] == pytest.approx(0.2)  # ttfts 0.1, 0.2, 0.2
    assert s.e2e_s["p99"] == pytest.approx(percentile([1.0, 1.0, 0.3], 99))


def test_steady_window_covers_only_the_time_every_client_is_busy():
    # client 0 sends at t=0 and finishes at t=10; client 1 starts at t=2 and finishes at t=12
    c0 = record(0.0, [(float(t), 1) for t in range(1, 11)], client=0)
    c1 = record(2.0, [(float(t), 1) for t in range(3, 13)], client=1)
    assert steady_window([c0, c1]) == (2.0, 10.0)
    s = summarize([c0, c1])
    # in [2, 10]: client 0's tokens at 2..10 (9) and client 1's at 3..10 (8)
    assert s.steady_s == pytest.approx(8.0)
    assert s.tokens_per_s == pytest.approx(17 / 8)
    assert s.requests_per_s == pytest.approx(1 / 8)  # client 0's request ended at 10, inside the window
    assert s.overall_tokens_per_s == pytest.approx(20 / 12)


def test_without_an_all_busy_window_the_whole_run_counts():
    c0 = record(0.0, [(1.0, 4)], client=0)
    c1 = record(2.0, [(3.0, 4)], client=1)  # starts after client 0 is done
    s = summarize([c0, c1])
    assert s.steady_s == pytest.approx(3.0)
    assert s.tokens_per_s == pytest.approx(8 / 3)


def test_summarize_refuses_nothing():
    with pytest.raises(ValueError):
        summarize([])
