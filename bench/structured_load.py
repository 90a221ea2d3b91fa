"""The systems `attnserve bench structured --part server` drives, each behind one call, and the clock on
the engine's masks.

    driver = EngineDriver(engine)                      # or AttnserveHttp(url), LlamaCppHttp(url)
    done, seconds = driver.run(prompts, seeds, limits, schema, concurrent=True)
    # schema given: constrained by it, at most limits[i] tokens; schema None: exactly limits[i] tokens (ignore_eos)
    with MaskClock(engine.grammars) as clock: ...      # then clock.summary()

Every request samples at temperature 1 with its own seed and nothing else (no top-k, top-p, min-p or
penalties), from prompt token ids. `concurrent`: every prompt at once (the streams), or one after another
(batch 1); `seconds` is the wall time from the first send to the last answer. Requests are not streamed.

- `EngineDriver`: `Engine.generate` in this process (the constraint a `Constraint("json_schema", ...)`).
- `AttnserveHttp`: `POST /v1/completions` of `attnserve serve`, the schema as `response_format`
  `{"type": "json_schema", ...}`; tokens are the answer's `usage.completion_tokens`.
- `LlamaCppHttp`: `POST /completion` of `llama-server`, the schema as its `json_schema` field (which it
  turns into a GBNF grammar), `"samplers": ["temperature"]`; tokens are its `tokens_predicted`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import threading
import time
from dataclasses import dataclass

import httpx2

from bench.peers.llama_cpp import Completions


@dataclass
class Completion:
    tokens: int  # tokens generated, as the system counts them
    text: str  # the completion's text
    finished: bool  # ended by the grammar or end of sequence, not by the token limit


class EngineDriver:
    name = "attnserve in-process"

    def __init__(self, engine):
        self.engine = engine
        self._ids = itertools.count()

    def request(self, prompt: list[int], seed: int, limit: int, schema: dict | None):
        from service.engine.request import Constraint, GenerationRequest, SamplingParams, StoppingCriteria

        if schema is None:
            stopping = StoppingCriteria(max_new_tokens=limit, min_new_tokens=limit, ignore_eos=True)
        else:
            stopping = StoppingCriteria(max_new_tokens=limit)
        constraint = Constraint("json_schema", json.dumps(schema)) if schema is not None else None
        return GenerationRequest(f"s{next(self._ids)}", list(prompt), SamplingParams(temperature=1.0, seed=seed),
                                 stopping, constraint=constraint)

    def run(self, prompts, seeds, limits, schema, concurrent: bool = True) -> tuple[list[Completion], float]:
        from service.engine.request import FinishReason

        requests = [self.request(p, s, n, schema) for p, s, n in zip(prompts, seeds, limits, strict=True)]
        start = time.perf_counter()
        done = self.engine.generate(requests) if concurrent else [self.engine.generate([r])[0] for r in requests]
        seconds = time.perf_counter() - start
        for g in done:
            if g.error is not None:
                raise RuntimeError(f"request {g.request_id} failed: {g.error}")
        return [Completion(len(g.events), "".join(e.text for e in g.events),
                           g.events[-1].finish_reason is not FinishReason.LENGTH) for g in done], seconds


class HttpDriver:
    """A server's completions endpoint over httpx2, one keep-alive connection per concurrent request,
    opened before the clock starts (`bench.peers.llama_cpp.Completions.connected`)."""

    name = path = ""

    def __init__(self, url: str):
        self.url = url
        self.retried = 0  # requests sent again: the server closed their kept-alive connection as they went out

    def body(self, prompt: list[int], seed: int, limit: int, schema: dict | None) -> dict:
        raise NotImplementedError

    def completion(self, data: dict) -> Completion:
        raise NotImplementedError

    def run(self, prompts, seeds, limits, schema, concurrent: bool = True) -> tuple[list[Completion], float]:
        bodies = [self.body(p, s, n, schema) for p, s, n in zip(prompts, seeds, limits, strict=True)]
        return asyncio.run(self._run(bodies, concurrent))

    async def _run(self, bodies: list[dict], concurrent: bool) -> tuple[list[Completion], float]:
        async with Completions.connected(self.url, len(bodies) if concurrent else 1) as client:
            start = time.perf_counter()
            if concurrent:
                answers = await asyncio.gather(*(self._post(client.http, b) for b in bodies))
            else:
                answers = [await self._post(client.http, b) for b in bodies]
            seconds = time.perf_counter() - start
        return [self.completion(a) for a in answers], seconds

    async def _post(self, http: httpx2.AsyncClient, body: dict) -> dict:
        try:
            response = await http.post(self.path, json=body)
        except httpx2.RemoteProtocolError:
            self.retried += 1
            response = await http.post(self.path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{self.name} answered {response.status_code}: {response.text[:500]}")
        return response.json()


class AttnserveHttp(HttpDriver):
    name, path = "attnserve HTTP", "/v1/completions"

    def body(self, prompt, seed, limit, schema):
        body = {"prompt": list(prompt), "temperature": 1.0, "seed": seed, "max_tokens": limit}
        if schema is None:
            return {**body, "min_tokens": limit, "ignore_eos": True}
        return {**body, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "order", "schema": schema, "strict": True}}}

    def completion(self, data):
        choice = data["choices"][0]
        return Completion(data["usage"]["completion_tokens"], choice["text"], choice["finish_reason"] != "length")


class LlamaCppHttp(HttpDriver):
    name, path = "llama.cpp server", "/completion"

    def body(self, prompt, seed, limit, schema):
        body = {"prompt": list(prompt), "temperature": 1.0, "samplers": ["temperature"], "seed": seed,
                "n_predict": limit, "repeat_penalty": 1.0, "cache_prompt": False}
        return {**body, "ignore_eos": True} if schema is None else {**body, "json_schema": schema}

    def completion(self, data):
        return Completion(data["tokens_predicted"], data["content"], data["stop_type"] != "limit")


class MaskClock:
    """Times the engine's mask work in this process without changing what it does. Wrapped: `Grammars.start_masks`
    (when the engine hands masks to the worker), `Grammars._fill` (on the worker thread, which fills every
    mask; a fill on the engine thread would be counted as a first mask) and `MaskJob.wait` (the engine
    thread, until the worker is done). Restored on exit."""

    def __init__(self, grammars):
        self.grammars = grammars
        self.fills: list[tuple[float, int, bool]] = []  # (seconds, rows, on the worker)
        # per worker job: (fill seconds, of them before the engine began to wait, seconds waited, submit to start)
        self.jobs: list[tuple[float, float, float, float]] = []
        self._wait = None

    def __enter__(self) -> MaskClock:
        from service.engine.grammar import MaskJob

        start_masks, fill, wait = self.grammars.start_masks, self.grammars._fill, MaskJob.wait
        engine_thread = threading.get_ident()
        self._wait = wait

        def timed_start(matchers):
            submitted = time.perf_counter()
            job = start_masks(matchers)
            job.bench_submitted = submitted
            return job

        def timed_fill(job) -> None:
            start = time.perf_counter()
            fill(job)
            end = time.perf_counter()
            job.bench_fill = (start, end)
            self.fills.append((end - start, len(job.matchers), threading.get_ident() != engine_thread))

        def timed_wait(job) -> None:
            start = time.perf_counter()
            wait(job)
            if job.future is not None and hasattr(job, "bench_fill"):
                begun, ended = job.bench_fill
                self.jobs.append((ended - begun, max(0.0, min(ended, start) - begun), time.perf_counter() - start,
                                  begun - job.bench_submitted))

        self.grammars.start_masks, self.grammars._fill = timed_start, timed_fill
        MaskJob.wait = timed_wait
        return self

    def __exit__(self, *exc) -> None:
        from service.engine.grammar import MaskJob

        del self.grammars.start_masks, self.grammars._fill
        MaskJob.wait = self._wait

    def summary(self) -> dict:
        """Mask µs per constrained token (every fill over every row); per worker job (one a decode step) its
        fill, how long after the hand-over the worker began it, the engine thread's wait, and `overlapped`:
        the share of the worker's fill time that ran before the engine began to wait (during the model
        call); the first masks, on the engine thread."""
        first = [s for s, _, on_worker in self.fills if not on_worker]
        rows = sum(r for _, r, _ in self.fills)
        fills, before, waits, delays = zip(*self.jobs, strict=True) if self.jobs else ((), (), (), ())
        worker_rows = [r for _, r, on_worker in self.fills if on_worker]

        def us(values) -> dict | None:
            if not values:
                return None
            return {"median": statistics.median(values) * 1e6, "mean": statistics.mean(values) * 1e6}

        return {"tokens": rows, "mask_us_per_token": sum(s for s, _, _ in self.fills) / rows * 1e6 if rows else None,
                "worker_jobs": len(self.jobs), "rows_per_job": statistics.median(worker_rows) if worker_rows else None,
                "fill_us": us(fills), "start_delay_us": us(delays), "wait_us": us(waits),
                "overlapped": sum(before) / sum(fills) if fills and sum(fills) else None,
                "first_masks": len(first), "first_mask_us": us(first),
                "engine_thread_us_per_token": (sum(waits) + sum(first)) / rows * 1e6 if rows else None}


class StepClock:
    """Where the engine's time goes per generated token, constrained or not, timed in this process without
    changing what the engine does: its model calls (`_run_prefill`, `_run_decode`), the decoding rows'
    masks, filled before the model call (`_masks`), the masks reaching the sampler (`_allowed`: the
    unpacking of the bits, and a new prompt's first masks), the sampler (`service.engine.core.sample`) and
    the output step (`OutputStep.update`, where each matcher consumes its token). Sums over every run
    inside it; restored on exit."""

    PARTS = ("_run_prefill", "_run_decode", "_masks", "_allowed", "sample", "update")

    def __init__(self, engine):
        self.engine = engine
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.wall = 0.0  # seconds inside runs timed with `run`
        self.tokens = 0

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def __enter__(self) -> StepClock:
        import service.engine.core as core

        for name in self.PARTS[:4]:
            setattr(self.engine, name, self._timed(name, getattr(self.engine, name)))
        self.engine.output.update = self._timed("update", self.engine.output.update)
        self._sample, core.sample = core.sample, self._timed("sample", core.sample)
        return self

    def __exit__(self, *exc) -> None:
        import service.engine.core as core

        for name in self.PARTS[:4]:
            delattr(self.engine, name)
        del self.engine.output.update
        core.sample = self._sample

    def add(self, done: list[Completion], seconds: float) -> None:
        self.tokens += sum(c.tokens for c in done)
        self.wall += seconds

    def summary(self) -> dict:
        """µs per generated token of each part, and of the rest of the run (the loop, scheduling, events)."""
        per = {name.strip("_"): s / self.tokens * 1e6 for name, s in self.seconds.items()} if self.tokens else {}
        wall = self.wall / self.tokens * 1e6 if self.tokens else None
        return {"tokens": self.tokens, "wall_us_per_token": wall, "us_per_token": per,
                "rest_us_per_token": wall - sum(per.values()) if self.tokens else None}
