"""Latency and throughput accounting for the load generator, on plain records (no gRPC here).

A `RequestRecord` is what one streamed request looked like from the client: when it was sent,
when each message arrived and how many tokens it carried, and how it ended. From a list of them:

- **TTFT**: first message with a token − send time.
- **ITL** (inter-token latency): the gap between consecutive messages of a request that carry
  tokens, one sample per gap (as a client sees them; a message carrying k tokens is one arrival).
- **TPOT** (time per output token): (end − first token) / (tokens − 1), one sample per request.
- **End-to-end**: last message − send time.
- **Throughput**, two ways:
  - *steady*: tokens that arrived while every client was busy (from the moment the last client sent
    its first request to the moment the first client received its last message), over that window;
    requests that ended in it, likewise. This is the rate at the stated concurrency, without the
    ramp-up and the tail.
  - *overall*: tokens of successful requests / the time from the first send to the last message.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bench.peers.protocol import percentile


@dataclass
class RequestRecord:
    sent: float  # perf_counter() when the call was started
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that message)
    code: str = "OK"  # how it ended: a gRPC status code name, or over HTTP a status ("429"; see bench.serve_http)
    expected_tokens: int | None = None  # what the request asked for, when known exactly
    client: int = 0  # which of the concurrent clients sent it
    server_ttft: float | None = None  # the server's own account (usage.ttft_ms), when it sent one
    server_queue: float | None = None  # time in the server's queue (usage.queue_ms)

    def arrived(self, when: float, tokens: int) -> None:
        self.arrivals.append((when, tokens))

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def token_arrivals(self) -> list[float]:
        return [t for t, n in self.arrivals if n > 0]

    @property
    def ttft(self) -> float | None:
        first = self.token_arrivals
        return first[0] - self.sent if first else None

    @property
    def end(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else self.sent

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    def itls(self) -> list[float]:
        times = self.token_arrivals
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        times, n = self.token_arrivals, self.tokens
        return (times[-1] - times[0]) / (n - 1) if times and n > 1 else None


@dataclass
class Summary:
    requests: int
    ok: int
    errors: dict[str, int]  # status code name -> count, failures only
    tokens: int  # generated tokens of successful requests
    short: int  # successful requests that returned fewer tokens than they asked for
    duration_s: float  # first send to last message
    tokens_per_s: float  # over the steady window (see the module docstring)
    requests_per_s: float
    steady_s: float  # the steady window's length
    overall_tokens_per_s: float
    overall_requests_per_s: float
    ttft_s: dict[str, float]  # p50 / p90 / p99 / mean
    itl_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    server_ttft_s: dict[str, float]  # TTFT as the server measured it (arrival to first token)
    server_queue_s: dict[str, float]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def describe(values: Sequence[float], qs: Iterable[int] = (50, 90, 99)) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) for q in qs}
    out["mean"] = sum(values) / len(values) if values else math.nan
    return out


def steady_window(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """(t0, t1): from the last client's first send to the first client's last message; t1 <= t0
    when no moment had every client busy."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for r in records:
        first[r.client] = min(first.get(r.client, math.inf), r.sent)
        last[r.client] = max(last.get(r.client, -math.inf), r.end)
    return max(first.values()), min(last.values())


def summarize(records: Sequence[RequestRecord]) -> Summary:
    if not records:
        raise ValueError("no requests to summarize")
    ok = [r for r in records if r.ok]
    start = min(r.sent for r in records)
    duration = max(r.end for r in records) - start
    tokens = sum(r.tokens for r in ok)
    t0, t1 = steady_window(records)
    if t1 > t0:
        steady_tokens = sum(n for r in ok for t, n in r.arrivals if t0 <= t <= t1)
        steady_requests = sum(1 for r in ok if t0 <= r.end <= t1)
        steady_s = t1 - t0
    else:  # never all busy at once (one request per client): the whole run is the window
        steady_tokens, steady_requests, steady_s = tokens, len(ok), duration
    errors = Counter(r.code for r in records if not r.ok)
    short = sum(1 for r in ok if r.expected_tokens is not None and r.tokens != r.expected_tokens)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [gap for r in ok for gap in r.itls()]
    return Summary(
        requests=len(records), ok=len(ok), errors=dict(sorted(errors.items())), tokens=tokens, short=short,
        duration_s=duration,
        tokens_per_s=steady_tokens / steady_s if steady_s > 0 else math.nan,
        requests_per_s=steady_requests / steady_s if steady_s > 0 else math.nan,
        steady_s=steady_s,
        overall_tokens_per_s=tokens / duration if duration > 0 else math.nan,
        overall_requests_per_s=len(ok) / duration if duration > 0 else math.nan,
        ttft_s=describe(ttfts), itl_s=describe(itls, (50, 90, 99)), tpot_s=describe(tpots),
        e2e_s=describe([r.e2e for r in ok]),
        server_ttft_s=describe([r.server_ttft for r in ok if r.server_ttft is not None]),
        server_queue_s=describe([r.server_queue for r in ok if r.server_queue is not None]),
    )
