"""Clients that stream one request after another until told to stop, each request recorded as its client saw it.

    load = StreamLoad(target, clients=32, new_tokens=32)      # gRPC GenerateStream; or HttpLoad(base_url)
    async with load.running():                                # the clients run inside
        await load.wait_for(lambda: load.completed_count() >= 64)
        load.phase = "roll"                                   # requests sent from now on are labelled so
    load.summary(refused)                                     # LoadSummary: sent, completed, failed, retried

Each request has its own id (`prefix-client-n`, sent as the request id and as X-Request-Id), so that a
server's log or a proxy's access log can say what happened to it. Each is an `Outcome`: when it was sent,
its first token, its tokens and how it ended. A request counts as retried in the summary when its id is
in `refused` (the ids the servers or the proxy sent elsewhere) and it completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import httpx2

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from bench.peers.protocol import percentile
from service.client.grpc_client import channel_options


@dataclass
class Outcome:
    """One request as its client saw it."""
    request_id: str
    sent: float
    phase: str  # what the fleet was doing when it was sent ("steady", "roll", ...); "first" for a client's first
    first_token: float | None = None
    tokens: int = 0
    code: str = ""  # "OK", a gRPC status name, an HTTP status, or "HUNG" (no end by its deadline)
    ended: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


@dataclass
class LoadSummary:
    sent: int
    completed: int  # OK with every token it asked for
    failed: dict[str, int]  # how the others ended
    short: int  # OK but fewer tokens than asked: never expected
    retried: int  # refused by a replica, then completed
    ttft_p99_s: dict[str, float] = field(default_factory=dict)  # by phase
    ttft_p50_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0

    @property
    def lost(self) -> int:
        return self.sent - self.completed

    def to_dict(self) -> dict:
        return {**self.__dict__, "lost": self.lost}


class Load:
    """Clients that each send one request after another until `stop()`; a request's id is `prefix-client-n`."""

    def __init__(self, clients: int = 32, new_tokens: int = 32, prompt_tokens: int = 8, deadline_s: float = 120.0,
                 prefix: str = "load"):
        self.clients, self.new_tokens, self.prompt_tokens = clients, new_tokens, prompt_tokens
        self.deadline_s = deadline_s
        self.prefix = prefix
        self.phase = "steady"
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._started = 0.0
        self._ended = 0.0

    def prompt(self, client: int, n: int) -> list[int]:
        return [(client * 31 + n * 7 + i) % 60 + 1 for i in range(self.prompt_tokens)]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        """The clients run inside; on leaving, each finishes the request it is in, then stops."""
        await self.open()
        self._started = time.monotonic()
        tasks = [asyncio.create_task(self._client(c)) for c in range(self.clients)]
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._ended = time.monotonic()
            await self.close()

    async def _client(self, c: int) -> None:
        n = 0
        while not self._stop.is_set():
            # a client's first request opens its connections: not a steady-state figure
            outcome = Outcome(f"{self.prefix}-{c}-{n}", time.monotonic(), "first" if n == 0 else self.phase)
            self.outcomes.append(outcome)
            try:
                await asyncio.wait_for(self.one(c, n, outcome), self.deadline_s + 30)
            except TimeoutError:
                outcome.code = "HUNG"
            outcome.ended = time.monotonic()
            n += 1

    async def wait_for(self, condition, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("the load did not reach the expected state in time")
            await asyncio.sleep(0.05)

    def completed_count(self) -> int:
        return sum(1 for o in self.outcomes if o.code == "OK")

    def summary(self, refused: set[str] = frozenset()) -> LoadSummary:
        done = [o for o in self.outcomes if o.code]
        ok = [o for o in done if o.code == "OK" and o.tokens == self.new_tokens]
        failed = Counter(o.code for o in done if o.code != "OK")
        by_phase: dict[str, list[float]] = {}
        for o in done:
            if o.ttft is not None:
                by_phase.setdefault(o.phase, []).append(o.ttft)
        span = (max(o.ended for o in done) - self._started) if done else 0.0
        return LoadSummary(
            sent=len(done), completed=len(ok), failed=dict(failed),
            short=sum(1 for o in done if o.code == "OK" and o.tokens != self.new_tokens),
            retried=sum(1 for o in ok if o.request_id in refused),
            ttft_p99_s={k: percentile(v, 99) for k, v in by_phase.items()},
            ttft_p50_s={k: percentile(v, 50) for k, v in by_phase.items()},
            tokens_per_s=sum(o.tokens for o in ok) / span if span else 0.0)

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def one(self, c: int, n: int, outcome: Outcome) -> None:
        raise NotImplementedError


class StreamLoad(Load):
    """gRPC `GenerateStream` clients, one channel each, with the shipped channel options (`round_robin` over
    every replica's address, or the plain ones through a proxy)."""

    def __init__(self, target: str, round_robin: bool = False, **kw):
        super().__init__(**kw)
        self.target, self.round_robin = target, round_robin
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[pb_grpc.TextGenerationStub] = []

    async def open(self) -> None:
        options = channel_options(self.round_robin)
        self.channels = [grpc.aio.insecure_channel(self.target, options=options) for _ in range(self.clients)]
        self.stubs = [pb_grpc.TextGenerationStub(ch) for ch in self.channels]
        await asyncio.gather(*(asyncio.wait_for(ch.channel_ready(), 60) for ch in self.channels))

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels))

    async def one(self, c: int, n: int, outcome: Outcome) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=self.prompt(c, n), request_id=outcome.request_id,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=self.new_tokens, ignore_eos=True))
        call = self.stubs[c].GenerateStream(request, timeout=self.deadline_s)
        try:
            async for msg in call:
                got = len(msg.token_ids)
                if got and outcome.first_token is None:
                    outcome.first_token = time.monotonic()
                outcome.tokens += got
            outcome.code = "OK"
        except grpc.aio.AioRpcError as e:
            outcome.code = e.code().name


class HttpLoad(Load):
    """Streaming `POST /v1/completions` clients (server-sent events), one keep-alive connection each."""

    def __init__(self, base_url: str, **kw):
        super().__init__(**kw)
        self.base_url = base_url
        self.clients_http: list[httpx2.AsyncClient] = []

    async def open(self) -> None:
        limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
        self.clients_http = [httpx2.AsyncClient(base_url=self.base_url, limits=limits, timeout=self.deadline_s)
                             for _ in range(self.clients)]

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients_http))

    async def one(self, c: int, n: int, outcome: Outcome) -> None:
        body = {"prompt": self.prompt(c, n), "max_tokens": self.new_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.clients_http[c].stream("POST", "/v1/completions", json=body,
                                                   headers={"X-Request-Id": outcome.request_id}) as r:
                if r.status_code != 200:
                    await r.aread()
                    outcome.code = str(r.status_code)
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        outcome.tokens = event["usage"]["completion_tokens"]
                    elif event.get("choices") and event["choices"][0].get("text") and outcome.first_token is None:
                        outcome.first_token = time.monotonic()
                outcome.code = "OK" if outcome.tokens else "NO_USAGE"
        except httpx2.HTTPError as e:
            outcome.code = type(e).__name__
