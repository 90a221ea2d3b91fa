"""`attnserve bench serve --protocol http`: the same load as the gRPC clients, over the OpenAI-compatible
HTTP front: one streaming `POST /v1/completions` per request, read as server-sent events.

    load = HttpLoad("http://127.0.0.1:8000", model="shakespeare")
    records = asyncio.run(load.drive(plan))        # plan: one list of workload items per client

Each item is sent as `{"model", "prompt": [token ids], "max_tokens": n, "min_tokens": n, "ignore_eos":
true, "temperature": 0, "seed", "stream": true, "stream_options": {"include_usage": true}, "timeout"}`,
the gRPC request field for field (`timeout` is the server-side deadline the gRPC call carries too).
The client is httpx2 (what the openai client is built on), with its own SSE parser and one keep-alive
connection per concurrent client, opened before the clock starts as the gRPC channel is.

What of its figures is exact, and how a stream becomes a record:
docs/BENCHMARKS.md#how-the-http-load-is-measured.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from urllib.parse import urlsplit

import httpx2

from bench import workload
from bench.stagger import Stagger
from bench.stats import RequestRecord
from service.fronts.status import CODES

STATUS_BY_TYPE = {type_: status for _, _, status, type_ in CODES}  # OpenAI error type -> HTTP status
CLIENT_GRACE_S = 10.0  # the client waits this much past the server's deadline before it gives up itself


def base_url(server: str) -> str:
    """`http://host:port` (or https://) as given; a bare `host:port` is plain HTTP."""
    url = server if "://" in server else f"http://{server}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{server!r} is not an HTTP base URL (http://host:port) or host:port")
    return url.rstrip("/")


def completion_body(item: workload.Item, seed: int, model: str | None, timeout_s: float) -> dict:
    body = {"prompt": item.prompt, "max_tokens": item.new_tokens, "min_tokens": item.new_tokens,
            "ignore_eos": True, "temperature": 0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}, "timeout": timeout_s}
    return {"model": model, **body} if model else body


def spread(total: int, chars: list[int]) -> list[int]:
    """`total` tokens over chunks of `chars` characters: in proportion to the characters, at least
    one each, summing to `total` exactly (largest remainders round up)."""
    m = len(chars)
    if total <= m:  # one token a chunk is all there is to give (fewer only if the server miscounted)
        return [1] * total + [0] * (m - total)
    all_chars = sum(chars)
    ideal = [total * c / all_chars for c in chars] if all_chars else [total / m] * m
    above_one = [max(x - 1.0, 0.0) for x in ideal]
    scale = (total - m) / sum(above_one)  # > 0: the ideals sum to total > m, so some exceed 1
    shares = [1.0 + a * scale for a in above_one]
    counts = [math.floor(s) for s in shares]
    for i in sorted(range(m), key=lambda i: counts[i] - shares[i])[:total - sum(counts)]:
        counts[i] += 1
    return counts


def error_code(error: dict) -> str:
    """An `error` event's HTTP status, from its OpenAI type."""
    status = STATUS_BY_TYPE.get(error.get("type"))
    return str(status) if status else str(error.get("type") or "error")


class HttpLoad:
    """Drives `/v1/completions` at `url`; learns the model's tokens per character as requests finish."""

    def __init__(self, url: str, model: str | None = None):
        self.url = base_url(url)
        self.model = model
        self.tokens = 0  # usage tokens of the requests finished so far ...
        self.chars = 0  # ... and the characters of their text

    def estimate(self, chars: int) -> float:
        """Tokens in a chunk of `chars` characters, before its request's usage is known."""
        return max(1.0, chars * self.tokens / self.chars) if self.chars else 1.0

    async def drive(self, plan: list[list[workload.Item]], timeout_s: float = 600.0,
                    stagger: bool = True) -> list[RequestRecord]:
        """Run `plan` (one list of items per client); one record per request, as `bench.commands.serve.drive`."""
        clients = len(plan)
        records: list[RequestRecord] = []
        bodies = [[completion_body(item, c * 1000 + i, self.model, timeout_s) for i, item in enumerate(items)]
                  for c, items in enumerate(plan)]
        gate = Stagger(clients, plan[0][0].new_tokens if plan and plan[0] else 0, on=stagger)
        limits = httpx2.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx2.AsyncClient(base_url=self.url, limits=limits,
                                      timeout=httpx2.Timeout(timeout_s + CLIENT_GRACE_S)) as http:
            # one connection per client, open before the clock starts (the gRPC channel is ready too)
            for response in await asyncio.gather(*(http.get("/health") for _ in range(clients))):
                response.raise_for_status()

            async def client(c: int) -> None:
                await gate.wait(c)
                for i, (item, body) in enumerate(zip(plan[c], bodies[c], strict=True)):
                    record = RequestRecord(time.perf_counter(), expected_tokens=item.new_tokens, client=c)
                    records.append(record)
                    first = c == 0 and i == 0
                    await self.send(http, body, record, gate.progressed if first else None)
                    if first:
                        gate.release()  # never leave a client waiting on a request that failed

            await asyncio.gather(*(client(c) for c in range(clients)))
        return records

    async def send(self, http: httpx2.AsyncClient, body: dict, record: RequestRecord, pace=None) -> None:
        """One request into `record`; `pace(tokens)` is told of each chunk's (estimated) tokens."""
        chunks: list[tuple[float, int]] = []  # (arrival time, characters of text)
        completion_tokens: int | None = None
        done = False
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    record.code = str(response.status_code)
                    return
                async for event in httpx2.EventSource(response):  # to the body's end: the connection is reused
                    now = time.perf_counter()
                    if event.data == "[DONE]":
                        done = True
                        continue
                    data = json.loads(event.data)
                    if "error" in data:  # [DONE] follows
                        record.code = error_code(data["error"])
                        continue
                    if data["choices"]:
                        chars = len(data["choices"][0]["text"])
                        chunks.append((now, chars))
                        if pace is not None:
                            pace(self.estimate(chars))
                    if data.get("usage"):
                        completion_tokens = data["usage"]["completion_tokens"]
            if record.ok and (not done or completion_tokens is None):
                record.code = "incomplete"
        except httpx2.HTTPError as e:
            record.code = type(e).__name__
        finally:
            self._record(record, chunks, completion_tokens)

    def _record(self, record: RequestRecord, chunks: list[tuple[float, int]], completion_tokens: int | None) -> None:
        chars = [n for _, n in chunks]
        if completion_tokens is None:  # no usage (the request failed): each chunk as the stagger counts it
            counts = [round(self.estimate(n)) for n in chars]
        else:
            counts = spread(completion_tokens, chars)
            self.tokens += completion_tokens
            self.chars += sum(chars)
        for (when, _), n in zip(chunks, counts, strict=True):
            record.arrived(when, n)
