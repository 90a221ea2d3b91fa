"""The load generator end to end, over real gRPC: against the no-op server and against attnserve."""

from __future__ import annotations

import asyncio

import pytest

from bench import workload
from bench.serve import drive
from bench.server_process import ServerProcess
from bench.stats import summarize


@pytest.fixture(scope="module")
def noop():
    with ServerProcess([], module="bench.noop_server") as srv:
        yield srv


def test_every_request_is_recorded_with_its_exact_token_count(noop):
    plan = workload.batches(workload.fixed(12, 4, 20, vocab=4096, seed=0), 4)
    records = asyncio.run(drive(noop.address, plan))
    s = summarize(records)
    assert (s.requests, s.ok, s.errors, s.short, s.tokens) == (12, 12, {}, 0, 240)
    assert sorted(r.client for r in records) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(len(r.itls()) == 19 and r.ttft is not None and r.ttft > 0 for r in records)
    assert s.tokens_per_s > 0 and s.steady_s > 0


def test_staggered_clients_start_after_client_0_has_progressed(noop):
    plan = workload.batches(workload.fixed(4, 4, 40, vocab=4096, seed=1), 4)
    records = asyncio.run(drive(noop.address, plan))
    first = next(r for r in records if r.client == 0)
    for c in (1, 2, 3):  # client c starts once client 0's first request has c/4 of its 40 tokens
        start = next(r for r in records if r.client == c).sent
        received = sum(n for t, n in first.arrivals if t <= start)
        assert received >= c * 10


def test_errors_are_counted_by_status_code(noop):
    # a million tokens cannot arrive within 0.2 s: the deadline ends the stream part-way
    records = asyncio.run(drive(noop.address, [[workload.Item([1, 2], 1_000_000)]], timeout_s=0.2))
    s = summarize(records)
    assert s.ok == 0 and s.errors == {"DEADLINE_EXCEEDED": 1} and s.tokens == 0
    assert 0 < records[0].tokens < 1_000_000


@pytest.mark.slow
def test_against_attnserve_every_stream_gets_exactly_what_it_asked(tiny_bundle):
    with ServerProcess(["serve", "--bundle", str(tiny_bundle), "--max-running", "8", "--max-batch-tokens", "64",
                        "--threads", "1"]) as srv:
        items = workload.mixed(12, vocab=97, context=128, seed=0)
        records = asyncio.run(drive(srv.address, workload.batches(items, 6)))
    s = summarize(records)
    assert s.errors == {} and s.short == 0 and s.tokens == sum(i.new_tokens for i in items)
    assert all(r.server_ttft is not None and 0 <= r.server_queue <= r.server_ttft for r in records)
