"""Which graph of the bundle to serve: the one asked for, or the fastest that is right on this machine.

    runner = open_serving_graph(bundle, graph)     # graph: a name, or "auto" (the default)

Only graphs whose KV cache holds `kv_dtype` (float32 unless asked; docs/engine.md#kv-precision) serve: the
cache's type is a deployment's choice of memory against quality, never made by timing. A named graph is opened
and must agree with the fp32 graph (`service.runtime.self_check`); if it does not,
start-up stops, unless `allow_low_agreement` serves it anyway with a warning. A named graph that is not
batch-invariant is served with one warning line saying what is lost. With "auto", every static-cache
graph of the bundle is a candidate:
1. each candidate is self-checked: a reduced-precision one against the fp32 graph, every one for
   batch invariance; one that fails either is dropped with a warning that says why;
2. the rest decode `TIMING_STEPS` steps at batch 1 and at batch `min(max_running, 32)`, in
   `TIMING_ROUNDS` interleaved rounds (so a noisy neighbour slows every candidate alike);
3. the one with the lowest geometric mean of its two median step times is served, and the log
   names every candidate's times and agreement. Candidates within `TIE_MARGIN` of the fastest
   count as tied, and of those the most precise is served (fp32, then 8-bit, then 4-bit), so that
   the choice, and with it the text a seed gives, does not flip between restarts on timing noise.

Batch 1 is bound by reading the weights, a full batch by the matmuls; which graph wins each can
differ by CPU, so the choice is measured where the server runs rather than fixed at export.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.runtime.bundle import AUTO_GRAPH, BundleError, KvDtype, read_manifest
from service.runtime.cpu import cpu_info
from service.runtime.self_check import SelfCheck, check, least_agreement, open_reference
from service.runtime.seq2seq_runner import Seq2SeqRunner
from service.runtime.session import Provider
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)

TIMING_ROUNDS = 3
TIMING_STEPS = 4
TIMING_PROMPT = 8  # tokens prefilled per row before the timed decode steps
MAX_TIMING_BATCH = 32
TIE_MARGIN = 0.10
PRECISION_RANK = {"float32": 0, "float16": 1, "int8": 2, "int4": 3}


@dataclass
class Candidate:
    runner: StaticRunner
    checked: SelfCheck | None  # what the self-check measured (None only for candidates made up by tests)
    step_ms: dict[int, float]  # batch size -> median decode step time

    @property
    def score(self) -> float:
        return math.exp(statistics.fmean(math.log(t) for t in self.step_ms.values()))

    def describe(self) -> str:
        times = ", ".join(f"{ms:.2f} ms at batch {b}" for b, ms in self.step_ms.items()) or "not timed"
        agreement = self.checked.agreement if self.checked else None
        agreed = f"; top-1 agreement {agreement.top1:.1%}" if agreement else ""
        invariant = "; batch-invariant" if self.checked and self.checked.invariance.identical else ""
        spec = self.runner.spec
        cache = f", {spec.cache_dtype} KV cache" if spec.cache_dtype != "float32" else ""
        return f"{self.runner.graph_name} ({spec.weights}{cache}): {times}{agreed}{invariant}"


def open_serving_graph(bundle: Path, graph: str = AUTO_GRAPH, provider: Provider = "cpu", threads: int = 0,
                       max_batch: int = MAX_TIMING_BATCH, allow_low_agreement: bool = False,
                       max_source: int | None = None, kv_dtype: KvDtype = "float32") -> StaticRunner:
    """The runner to serve `bundle` with, checked on this machine (raises `BundleError`): `graph`, or with
    "auto" the fastest batch-invariant graph that passes the self-check, timed at batch 1 and `max_batch`
    (at most 32); either with its KV cache in `kv_dtype`. `allow_low_agreement` serves a named graph that
    disagrees with fp32 (never under auto). `max_source`: the source positions an encoder-decoder's slots hold
    (default: its longest source)."""
    encoder_decoder = read_manifest(bundle).model.encoder_decoder
    if max_source is not None and not encoder_decoder:
        raise BundleError(f"{bundle} holds a decoder-only model: max_source_tokens applies to encoder-decoders")

    def open_(name: str | None) -> StaticRunner:
        if encoder_decoder:
            return open_encoder_decoder(bundle, name, provider, threads, max_source)
        return StaticRunner(bundle, name, provider, threads)

    if graph != AUTO_GRAPH:
        runner = open_(graph)
        if runner.spec.cache_dtype != kv_dtype:
            raise BundleError(f"graph {runner.graph_name!r} keeps its KV cache in {runner.spec.cache_dtype}, not "
                              f"{kv_dtype}: serve it with --kv-dtype {runner.spec.cache_dtype}")
        if not check(runner, allow_low_agreement=allow_low_agreement).invariance.identical:
            log.warning("graph %s is not batch-invariant on this CPU: a request's tokens, greedy or seeded, can "
                        "change with the other requests in its batch; --graph auto serves only graphs that are",
                        runner.graph_name)
        return runner
    manifest = read_manifest(bundle)
    static = {name: spec for name, spec in manifest.graphs.items() if spec.cache == "static"}
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
    candidates = []
    for runner in runners:
        try:
            checked = check(runner, reference)
        except BundleError as e:
            log.warning("graph choice: not serving %s: %s", runner.graph_name, e)
            continue
        if checked.invariance.identical:
            candidates.append(Candidate(runner, checked, {}))
        else:
            log.warning("graph choice: not serving %s: it is not batch-invariant on this CPU (%s), so a request's "
                        "tokens would depend on the other requests in its batch; name it with --graph to serve it "
                        "anyway", runner.graph_name, checked.invariance.describe())
    if not candidates:
        raise BundleError(f"no graph of {bundle} passes the self-check and is batch-invariant on this CPU "
                          f"({cpu_info().describe()}); the warnings above say why; name one with --graph to serve "
                          "it anyway")
    if len(candidates) == 1:  # nothing to choose
        log.info("graph choice on %s: serving %s, the only graph that passes the self-check", cpu_info().describe(),
                 candidates[0].describe())
        return candidates[0].runner
    time_decode(candidates, min(max_batch, MAX_TIMING_BATCH))
    best = choose(candidates)
    log.info("graph choice on %s: serving %s (the lowest geometric mean of the step times, or the most precise "
             "within %.0f%% of it); measured: %s", cpu_info().describe(), best.runner.graph_name, 100 * TIE_MARGIN,
             "; ".join(c.describe() for c in candidates))
    return best.runner


def open_encoder_decoder(bundle: Path, graph: str | None, provider: Provider, threads: int,
                         max_source: int | None = None) -> Seq2SeqRunner:
    """An encoder-decoder bundle's runner, on the CPU (no other provider has been checked against it)."""
    try:
        runner = Seq2SeqRunner(bundle, graph, provider, threads, max_source=max_source)
    except ValueError as e:
        raise BundleError(str(e)) from None
    if runner.provider != "CPUExecutionProvider":
        raise BundleError(f"an encoder-decoder graph is served on the CPU; {runner.graph_name!r} opened on "
                          f"{runner.provider}: serve it with provider 'cpu'")
    return runner


def choose(candidates: list[Candidate]) -> Candidate:
    fastest = min(c.score for c in candidates)
    tied = [c for c in candidates if c.score <= fastest * (1 + TIE_MARGIN)]
    return min(tied, key=lambda c: PRECISION_RANK[c.runner.spec.weights])


def time_decode(candidates: list[Candidate], batch: int) -> None:
    """Fill each candidate's `step_ms` at batch 1 and `batch`, rounds interleaved across candidates."""
    sizes = sorted({1, batch})
    samples: dict[tuple[int, int], list[float]] = {(i, b): [] for i in range(len(candidates)) for b in sizes}
    for _ in range(TIMING_ROUNDS):
        for i, c in enumerate(candidates):
            for b in sizes:
                samples[i, b] += decode_step_ms(c.runner, b, TIMING_STEPS)
    for i, c in enumerate(candidates):
        c.step_ms = {b: statistics.median(samples[i, b]) for b in sizes}


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
