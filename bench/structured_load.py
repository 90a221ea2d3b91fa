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
    """Times the engine's masks in this process without changing what it does: `Grammars.masks` (a step's
    constrained rows at once, on the engine thread) is wrapped, and restored on exit."""

    def __init__(self, grammars):
        self.grammars = grammars
        self.calls: list[tuple[float, int]] = []  # (seconds, rows)

    def __enter__(self) -> MaskClock:
        masks = self.grammars.masks

        def timed(matchers):
            start = time.perf_counter()
            try:
                return masks(matchers)
            finally:
                self.calls.append((time.perf_counter() - start, len(matchers)))

        self.grammars.masks = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.grammars.masks

    def summary(self) -> dict:
        """Mask µs per constrained token (every call over every row), and per call (one a step)."""
        if not self.calls:
            return {"tokens": 0, "mask_us_per_token": None, "calls": 0, "rows_per_call": None, "call_us": None}
        seconds, rows = zip(*self.calls, strict=True)
        return {"tokens": sum(rows), "mask_us_per_token": sum(seconds) / sum(rows) * 1e6, "calls": len(rows),
                "rows_per_call": statistics.median(rows),
                "call_us": {"median": statistics.median(seconds) * 1e6, "mean": statistics.mean(seconds) * 1e6}}


class StepClock:
    """Where the engine's time goes per generated token, constrained or not, timed in this process without
    changing what the engine does: its model calls (`RunStep.prefill`, `RunStep.decode`), the constrained rows'
    masks (`SampleStep._masks_of`: computed, and unpacked for the sampler), the sampler
    (`service.engine.sample_step.sample`) and the output step (`OutputStep.update`, where each matcher consumes
    its token). Sums over every run inside it; restored on exit."""

    PARTS = ("run_prefill", "run_decode", "masks_of", "sample", "update")

    def __init__(self, engine):
        self.engine = engine
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.wall = 0.0  # seconds inside runs timed with `run`
        self.tokens = 0
        # part -> (the object whose method is timed, its name); the sampler is a module function
        self._methods = {"run_prefill": (engine.run_step, "prefill"), "run_decode": (engine.run_step, "decode"),
                         "masks_of": (engine.sample_step, "_masks_of"), "update": (engine.output, "update")}

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def __enter__(self) -> StepClock:
        import service.engine.sample_step as sample_step

        for name, (owner, method) in self._methods.items():
            setattr(owner, method, self._timed(name, getattr(owner, method)))
        self._sample, sample_step.sample = sample_step.sample, self._timed("sample", sample_step.sample)
        return self

    def __exit__(self, *exc) -> None:
        import service.engine.sample_step as sample_step

        for owner, method in self._methods.values():
            delattr(owner, method)
        sample_step.sample = self._sample

    def add(self, done: list[Completion], seconds: float) -> None:
        self.tokens += sum(c.tokens for c in done)
        self.wall += seconds

    def summary(self) -> dict:
        """µs per generated token of each part, and of the rest of the run (the loop, scheduling, events)."""
        per = {name: s / self.tokens * 1e6 for name, s in self.seconds.items()} if self.tokens else {}
        wall = self.wall / self.tokens * 1e6 if self.tokens else None
        return {"tokens": self.tokens, "wall_us_per_token": wall, "us_per_token": per,
                "rest_us_per_token": wall - sum(per.values()) if self.tokens else None}
