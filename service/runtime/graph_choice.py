"""Which graph of the bundle to serve: the one asked for, or the fastest that is right on this machine.

    runner = open_serving_graph(bundle, graph)                    # graph: a name, or "auto" (the default)
    runner = open_serving_graph(bundle, graph, cache_dir=path)    # what it measured, kept for the next start

Only graphs whose KV cache holds `kv_dtype` (float32 unless asked; docs/engine.md#kv-precision) serve: the
cache's type is a deployment's choice of memory against quality, never made by timing. A named graph is opened
and must agree with the fp32 graph (`service.runtime.self_check`); if it does not, start-up stops, unless
`allow_low_agreement` serves it anyway with a warning. A named graph that is not batch-invariant is served
with one warning line saying what is lost. With "auto", every static-cache graph of the bundle with that KV
cache is a candidate:
1. every candidate decodes `TIMING_STEPS` steps at batch 1 and at batch `min(max_running, 32)`, in
   `TIMING_ROUNDS` interleaved rounds (so a noisy neighbour slows every candidate alike), at the first
   positions of a cache of its own: a small part of what self-checking it costs;
2. `choose` picks the one with the lowest geometric mean of its two median step times. Candidates within
   `TIE_MARGIN` of the fastest count as tied, and of those the most precise is picked (fp32, then 8-bit,
   then 4-bit), so that the choice, and with it the text a seed gives, does not flip between restarts on
   timing noise;
3. the pick alone is self-checked: a reduced-precision graph against the fp32 graph, any graph for batch
   invariance. One that fails either is dropped with a warning that says why, and `choose` picks again
   among the rest. The first pick that passes is served; the log names every candidate's times and its
   agreement.
So a graph served by "auto" has passed the agreement and invariance checks on this CPU, and start-up pays
for checking the graph it serves (and any pick that failed before it), not for checking every graph.

With `cache_dir`, what was measured (the graph served, its verdict, every candidate's times, the graphs
refused and why) is kept per bundle, CPU and settings (`choice_cache.py`). A start that finds it opens that
graph alone and serves it without checking or timing anything, and its log says so and where the cache
lives; `recheck` measures again and replaces it. Off the CPU nothing is cached (the GPU is not in the key).

Batch 1 is bound by reading the weights, a full batch by the matmuls; which graph wins each can
differ by CPU, so the choice is measured where the server runs rather than fixed at export.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.runtime.bundle import AUTO_GRAPH, BundleError, KvDtype, read_manifest
from service.runtime.choice_cache import CachedChoice, ChoiceCache
from service.runtime.cpu import cpu_info
from service.runtime.self_check import SelfCheck, check, least_agreement, open_reference, probes_for
from service.runtime.seq2seq_runner import Seq2SeqRunner
from service.runtime.session import PROVIDER_NAMES, Provider, choose_providers
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)

TIMING_ROUNDS = 3
TIMING_STEPS = 1  # per round, candidate and batch size: each round is one more sample
TIMING_PROMPT = 8  # tokens prefilled per row before the timed decode steps (decode_step_ms, for benchmarks)
MAX_TIMING_BATCH = 32
TIE_MARGIN = 0.10
PRECISION_RANK = {"float32": 0, "float16": 1, "int8": 2, "int4": 3}


@dataclass
class Candidate:
    runner: StaticRunner
    checked: SelfCheck | None  # what the self-check measured (None: not checked)
    step_ms: dict[int, float]  # batch size -> median decode step time

    @property
    def name(self) -> str:
        return self.runner.graph_name

    @property
    def score(self) -> float:
        return math.exp(statistics.fmean(math.log(t) for t in self.step_ms.values()))

    def describe(self) -> str:
        times = ", ".join(f"{ms:.2f} ms at batch {b}" for b, ms in self.step_ms.items()) or "not timed"
        spec = self.runner.spec
        what = spec.weights + (f", {spec.cache_dtype} KV cache" if spec.cache_dtype != "float32" else "")
        if self.checked is None:
            return f"{self.name} ({what}): {times}; not checked"
        agreement = self.checked.agreement
        agreed = f"; top-1 agreement {agreement.top1:.1%}" if agreement else ""
        invariant = "; batch-invariant" if self.checked.invariance.identical else ""
        return f"{self.name} ({what}): {times}{agreed}{invariant}"


def open_serving_graph(bundle: Path, graph: str = AUTO_GRAPH, provider: Provider = "cpu", threads: int = 0,
                       max_batch: int = MAX_TIMING_BATCH, allow_low_agreement: bool = False,
                       max_source: int | None = None, cache_dir: Path | None = None,
                       recheck: bool = False, kv_dtype: KvDtype = "float32", spin: bool = True) -> StaticRunner:
    """The runner to serve `bundle` with, checked on this machine (raises `BundleError`): `graph`, or with
    "auto" the fastest batch-invariant graph that passes the self-check, timed at batch 1 and `max_batch`
    (at most 32); either with its KV cache in `kv_dtype`. `allow_low_agreement` serves a named graph that
    disagrees with fp32 (never under auto).
    `max_source`: the source positions an encoder-decoder's slots hold (default: its longest source).
    `cache_dir`: where what was measured is kept for the next start (None: nowhere); `recheck` measures
    again even if it is kept. `spin`: the sessions' idle threads spin (`create_session`)."""
    encoder_decoder = read_manifest(bundle).model.encoder_decoder
    if max_source is not None and not encoder_decoder:
        raise BundleError(f"{bundle} holds a decoder-only model: max_source_tokens applies to encoder-decoders")

    def open_(name: str | None) -> StaticRunner:
        if encoder_decoder:
            return open_encoder_decoder(bundle, name, provider, threads, max_source, spin)
        return StaticRunner(bundle, name, provider, threads, spin=spin)

    batch = min(max_batch, MAX_TIMING_BATCH)
    named = graph != AUTO_GRAPH
    cache = None
    if cache_dir is not None and choose_providers(provider) == [PROVIDER_NAMES["cpu"]]:
        settings = {"graph": graph, "provider": provider, "threads": threads, "timing_batch": None if named else batch,
                    "allow_low_agreement": allow_low_agreement and named, "max_source": max_source,
                    "kv_dtype": kv_dtype}
        cache = ChoiceCache.of(bundle, cache_dir, settings)
    cached = cache.load(recheck) if cache is not None else None
    if cached is not None:
        return serve_cached(open_(cached.served), cached, cache)
    if named:
        runner = open_(graph)
        if runner.spec.cache_dtype != kv_dtype:
            raise BundleError(f"graph {runner.graph_name!r} keeps its KV cache in {runner.spec.cache_dtype}, not "
                              f"{kv_dtype}: serve it with --kv-dtype {runner.spec.cache_dtype}")
        checked = check(runner, allow_low_agreement=allow_low_agreement)
        warn_if_not_invariant(runner, checked)
        chosen, outcome = runner, CachedChoice(runner.graph_name, {runner.graph_name: checked})
    else:
        chosen, outcome = choose_and_check(bundle, open_, batch, kv_dtype)
    if cache is not None:
        cache.store(outcome)
    return chosen


def choose_and_check(bundle: Path, open_: Callable[[str | None], StaticRunner], batch: int,
                     kv_dtype: KvDtype = "float32") -> tuple[StaticRunner, CachedChoice]:
    """`--graph auto` (the module docstring): every static graph with its KV cache in `kv_dtype` timed, then picks
    self-checked until one passes. Returns its runner and what was measured."""
    static = {name: spec for name, spec in read_manifest(bundle).graphs.items() if spec.cache == "static"}
    names = [name for name, spec in static.items() if spec.cache_dtype == kv_dtype]
    if static and not names:
        raise BundleError(f"{bundle} has no serving graph whose KV cache is {kv_dtype} (it has "
                          f"{', '.join(f'{n} ({s.cache_dtype})' for n, s in static.items())}); re-export it with "
                          f"'attnserve export --kv-dtype {kv_dtype}', or serve another --kv-dtype")
    runners = [open_(name) for name in names] if names else [open_(None)]  # no static graph: the runner says so
    reference = next((r for r in runners if least_agreement(r.spec) is None and r.provider == "CPUExecutionProvider"),
                     None)
    if reference is None and kv_dtype != "float32":  # the fp32 graph the candidates are checked against, once
        reference = open_reference(runners[0])
    timed = [Candidate(runner, None, {}) for runner in runners]
    started = time.perf_counter()
    if len(timed) > 1:
        time_decode(timed, batch)
    timing_s, started = time.perf_counter() - started, time.perf_counter()
    candidates, refused, probe = list(timed), {}, None
    while candidates:
        pick = choose(candidates)
        if probe is None and reference is not None:  # one probe for every graph checked against the reference
            probe = probes_for(reference).probe(reference)
        try:
            pick.checked = check(pick.runner, reference, probe=probe)
            why = None if pick.checked.invariance.identical else (
                f"it is not batch-invariant on this CPU ({pick.checked.invariance.describe()}), so a request's "
                "tokens would depend on the other requests in its batch; name it with --graph to serve it anyway"
                f"{int4_hint(pick.runner)}")
        except BundleError as e:
            why = str(e)
        if why is None:
            break
        log.warning("graph choice: not serving %s: %s", pick.name, why)
        refused[pick.name] = why
        candidates.remove(pick)
    else:
        raise BundleError(f"no graph of {bundle} passes the self-check and is batch-invariant on this CPU "
                          f"({cpu_info().describe()}); the warnings above say why; name one with --graph to serve "
                          "it anyway")
    others = [c.describe() for c in timed if c is not pick and c.name not in refused]
    how = ("the bundle's only serving graph" if len(timed) == 1 else "the only one left" if len(candidates) == 1 else
           f"the lowest geometric mean of the step times, or the most precise within {100 * TIE_MARGIN:.0f}% of it")
    log.info("graph choice on %s: serving %s (%s; timed in %.1f s, self-checked in %.1f s)%s", cpu_info().describe(),
             pick.describe(), how, timing_s, time.perf_counter() - started,
             f"; also measured: {'; '.join(others)}" if others else "")
    outcome = CachedChoice(pick.name, {pick.name: pick.checked}, refused,
                           {c.name: c.step_ms for c in timed if c.step_ms})
    return pick.runner, outcome


def serve_cached(runner: StaticRunner, cached: CachedChoice, cache: ChoiceCache) -> StaticRunner:
    """`runner`, the graph a start before this one chose and checked, served as it was then."""
    chosen = Candidate(runner, cached.checked[runner.graph_name], cached.step_ms.get(runner.graph_name, {}))
    refused = "".join(f"; not serving {name}: {why}" for name, why in cached.refused.items())
    log.info("graph choice on %s: serving %s (the choice a start made on %s with this bundle, CPU and settings, "
             "cached in %s: not checked again; --recheck checks again)%s", cpu_info().describe(), chosen.describe(),
             cached.checked_at, cache.path, refused)
    agreement = chosen.checked.agreement
    least = least_agreement(runner.spec)
    if agreement is not None and least is not None and agreement.top1 < least:
        log.warning("serving it anyway (allow_low_agreement): graph %s agreed with the fp32 graph on the top-1 token "
                    "at only %.1f%% of the probe positions when it was checked", runner.graph_name,
                    100 * agreement.top1)
    warn_if_not_invariant(runner, chosen.checked)
    return runner


def warn_if_not_invariant(runner: StaticRunner, checked: SelfCheck) -> None:
    if not checked.invariance.identical:
        log.warning("graph %s is not batch-invariant on this CPU: a request's tokens, greedy or seeded, can "
                    "change with the other requests in its batch; --graph auto serves only graphs that are%s",
                    runner.graph_name, int4_hint(runner))


def int4_hint(runner: StaticRunner) -> str:
    """What a 4-bit graph that fails the batch-invariance probe can be exported as instead."""
    if runner.spec.weights != "int4":
        return ""
    return (" (a 4-bit graph of block 16 is batch-invariant on AVX2 and AVX-512 VNNI CPUs: attnserve export --int4 "
            "--int4-block-size 16; docs/onnx.md, 'Batch invariance, CPU by CPU')")


def open_encoder_decoder(bundle: Path, graph: str | None, provider: Provider, threads: int,
                         max_source: int | None = None, spin: bool = True) -> Seq2SeqRunner:
    """An encoder-decoder bundle's runner, on the CPU (no other provider has been checked against it)."""
    try:
        runner = Seq2SeqRunner(bundle, graph, provider, threads, max_source=max_source, spin=spin)
    except ValueError as e:
        raise BundleError(str(e)) from None
    if runner.provider != "CPUExecutionProvider":
        raise BundleError(f"an encoder-decoder graph is served on the CPU; {runner.graph_name!r} opened on "
                          f"{runner.provider}: serve it with provider 'cpu'")
    return runner


def choose(candidates: list[Candidate]) -> Candidate:
    if len(candidates) == 1 or not all(c.step_ms for c in candidates):
        return min(candidates, key=lambda c: PRECISION_RANK[c.runner.spec.weights])
    fastest = min(c.score for c in candidates)
    tied = [c for c in candidates if c.score <= fastest * (1 + TIE_MARGIN)]
    return min(tied, key=lambda c: PRECISION_RANK[c.runner.spec.weights])


def time_decode(candidates: list[Candidate], batch: int) -> None:
    """Fill each candidate's `step_ms` at batch 1 and `batch`: decode steps at the first positions of a cache of
    its own, rounds interleaved across candidates. Each size's first run is untimed, since onnxruntime allocates
    then: `batch` one-token prompts are prefilled first (a call of the same shapes), then one decode at batch 1."""
    sizes = sorted({1, batch})
    samples: dict[tuple[int, int], list[float]] = {(i, b): [] for i in range(len(candidates)) for b in sizes}
    calls = 1 + TIMING_ROUNDS * TIMING_STEPS  # per candidate and size, each at the next position
    with ExitStack() as scratch:
        for c in candidates:
            scratch.enter_context(c.runner.scratch_cache(batch, calls + 1))
            c.runner.prefill_batch(0, [[0]] * batch)
            decode_ms(c.runner, 1, 1)
        for r in range(TIMING_ROUNDS):
            for i, c in enumerate(candidates):
                for b in sizes:
                    samples[i, b] += [decode_ms(c.runner, b, 2 + r * TIMING_STEPS + s) for s in range(TIMING_STEPS)]
    for i, c in enumerate(candidates):
        c.step_ms = {b: statistics.median(samples[i, b]) for b in sizes}


def decode_ms(runner: StaticRunner, rows: int, position: int) -> float:
    """One decode step's time (ms) at `rows` rows, each at `position`."""
    started = time.perf_counter()
    runner.decode(np.zeros(rows, dtype=np.int64), np.full(rows, position))
    return 1000 * (time.perf_counter() - started)


def decode_step_ms(runner: StaticRunner, batch: int, steps: int, prompt_tokens: int = TIMING_PROMPT) -> list[float]:
    """Times (ms) of `steps` greedy decode steps at `batch` rows after a `prompt_tokens` prefill (an
    encoder-decoder's: sources of that many tokens), on a short cache of its own, after one untimed
    warm-up step."""
    if isinstance(runner, Seq2SeqRunner):
        prompt_tokens = min(prompt_tokens, runner.max_source)
    with runner.scratch_cache(batch, prompt_tokens + steps + 1):
        vocab = runner.vocab_size
        prompts = [[(7 * row + t) % vocab for t in range(prompt_tokens)] for row in range(batch)]
        ids = runner.prefill_batch(0, prompts).argmax(-1)
        times = []
        for step in range(steps + 1):
            started = time.perf_counter()
            ids = runner.decode(ids, np.full(batch, prompt_tokens + step)).argmax(-1)
            times.append(1000 * (time.perf_counter() - started))
        return times[1:]
