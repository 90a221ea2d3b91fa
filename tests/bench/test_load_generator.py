"""The load generator end to end, over real gRPC and HTTP: against the no-op server and against attnserve."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import noop_server, workload
from bench.commands.serve import drive, main
from bench.serve_http import HttpLoad
from bench.stats import summarize
from service.client.server_process import ServerProcess


@pytest.fixture(scope="module")
def noop():
    with ServerProcess(command=noop_server.COMMAND, name="noop") as srv:
        yield srv


@pytest.fixture(params=["grpc", "http"])
def load(request, noop):
    """`drive(plan, **options)` against the no-op server, over each protocol."""
    if request.param == "http":
        return HttpLoad(noop.http_url).drive
    return lambda plan, **options: drive(noop.address, plan, **options)


def test_every_request_is_recorded_with_its_exact_token_count(load):
    plan = workload.batches(workload.fixed(12, 4, 20, vocab=4096, seed=0), 4)
    records = asyncio.run(load(plan))
    s = summarize(records)
    assert (s.requests, s.ok, s.errors, s.short, s.tokens) == (12, 12, {}, 0, 240)
    assert sorted(r.client for r in records) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(len(r.itls()) == 19 and r.ttft is not None and r.ttft > 0 for r in records)
    assert s.tokens_per_s > 0 and s.steady_s > 0


def test_staggered_clients_start_after_client_0_has_progressed(load):
    plan = workload.batches(workload.fixed(4, 4, 40, vocab=4096, seed=1), 4)
    records = asyncio.run(load(plan))
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
    with ServerProcess(["--bundle", str(tiny_bundle), "--max-running", "8", "--max-batch-tokens", "64",
                        "--threads", "1"]) as srv:
        items = workload.mixed(12, vocab=97, context=128, seed=0)
        records = asyncio.run(drive(srv.address, workload.batches(items, 6)))
    s = summarize(records)
    assert s.errors == {} and s.short == 0 and s.tokens == sum(i.new_tokens for i in items)
    assert all(r.server_ttft is not None and 0 <= r.server_queue <= r.server_ttft for r in records)


@pytest.mark.slow
def test_over_http_against_attnserve_every_stream_gets_exactly_what_it_asked(tiny_bundle, tmp_path, capsys):
    with ServerProcess(["--bundle", str(tiny_bundle), "--max-running", "8", "--max-batch-tokens", "64",
                        "--threads", "1"]) as srv:
        items = workload.mixed(12, vocab=97, context=128, seed=0)
        records = asyncio.run(HttpLoad(srv.http_url, model="tiny").drive(workload.batches(items, 6)))
        refused = asyncio.run(HttpLoad(srv.http_url).drive([[workload.Item([10**6], 4)]]))  # not a token id
        # the command line: --server is the HTTP front, --grpc-server the same server's gRPC port
        code = main(["--protocol", "http", "--server", srv.http_url, "--grpc-server", srv.address, "--noop-check",
                     "--concurrency", "1,2", "--new-tokens", "4", "--requests-per-client", "1", "--out", str(tmp_path)])
    s = summarize(records)
    assert s.errors == {} and s.short == 0 and s.tokens == sum(i.new_tokens for i in items)
    assert all(r.ttft is not None and r.ttft > 0 and min(n for _, n in r.arrivals) >= 1 for r in records)
    assert summarize(refused).errors == {"400": 1}
    out = capsys.readouterr().out
    assert code == 0 and "## HTTP load (streaming /v1/completions) (fixed workload)" in out
    assert "no-op server (`bench.noop_server`, one token per chunk)" in out  # the client side, over HTTP too
    result = json.loads((tmp_path / "serve-http.json").read_text())
    assert result["protocol"] == "http" and [lv["tokens"] for lv in result["levels"]] == [4, 8]
    assert not (tmp_path / "serve.json").exists()  # the gRPC results are left alone
