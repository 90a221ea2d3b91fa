"""The HTTP load generator's accounting, on canned server-sent events (no server): how chunks become a
`RequestRecord`, and how a stream's end becomes a status code."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from bench.commands.serve import http_addresses
from bench.serve_http import HttpLoad, base_url, spread
from bench.stats import RequestRecord


@pytest.mark.parametrize(("total", "chars", "expected"), [
    (9, [3, 24], [1, 8]),  # a lone first token, then eight in a chunk of eight times the text
    (12, [4, 4, 4], [4, 4, 4]),
    (5, [0, 0, 0], [2, 2, 1]),  # no text at all (partial characters): evenly
    (4, [0, 9, 3], [1, 2, 1]),  # a chunk without text still carries a token
    (2, [5, 5, 5], [1, 1, 0]),  # a server that counts fewer tokens than chunks: no more than it says
])
def test_a_requests_tokens_are_spread_over_its_chunks_by_their_text(total, chars, expected):
    assert spread(total, chars) == expected


def test_spread_always_sums_to_the_usage_and_gives_every_chunk_a_token():
    for total in range(4, 40):  # four chunks carry four tokens or more
        counts = spread(total, [1, 7, 0, 3])
        assert sum(counts) == total and min(counts) >= 1


def test_server_addresses():
    assert base_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert base_url("https://example.org:8443/") == "https://example.org:8443"
    assert http_addresses("http://10.0.0.5:8000", None) == ("10.0.0.5:50051", "http://10.0.0.5:8000")
    assert http_addresses("[::1]:8000", "[::1]:6000") == ("[::1]:6000", "http://[::1]:8000")
    assert http_addresses("http://[::1]:8000", None)[0] == "[::1]:50051"
    with pytest.raises(ValueError, match="not an HTTP base URL"):
        base_url("grpc://host:1")


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


def chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}}


def record_of(status: int, body: bytes) -> RequestRecord:
    async def run() -> RequestRecord:
        kind = "text/event-stream" if status == 200 else "application/json"
        transport = httpx2.MockTransport(lambda request: httpx2.Response(status, content=body,
                                                                         headers={"content-type": kind}))
        record = RequestRecord(0.0, expected_tokens=7)
        async with httpx2.AsyncClient(base_url="http://test", transport=transport) as http:
            await HttpLoad("http://test").send(http, {}, record)
        return record

    return asyncio.run(run())


def test_a_whole_stream_has_the_usage_tokens_one_arrival_per_chunk():
    record = record_of(200, sse(chunk("a"), chunk("bcd"), chunk(""), chunk("efg"), USAGE, "[DONE]"))
    assert record.ok and record.tokens == 7
    assert [n for _, n in record.arrivals] == [1, 3, 1, 2]


@pytest.mark.parametrize(("status", "body", "code"), [
    (429, b'{"error": {"type": "rate_limit_error"}}', "429"),  # refused before the stream: the response status
    (200, sse(chunk("a"), {"error": {"type": "timeout_error", "message": "deadline"}}, "[DONE]"), "408"),
    (200, sse(chunk("a"), {"error": {"type": "server_error", "message": "bug"}}, "[DONE]"), "500"),
    (200, sse(chunk("a"), chunk("b"), USAGE), "incomplete"),  # no [DONE]: the body was cut short
    (200, sse(chunk("a"), "[DONE]"), "incomplete"),  # no usage: its tokens are not known
])
def test_how_a_stream_ends_is_its_code(status, body, code):
    record = record_of(status, body)
    assert record.code == code and not record.ok
    assert len(record.arrivals) == body.count(b'"text"')  # what did arrive is still recorded (its TTFT)
