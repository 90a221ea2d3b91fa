"""The start-up self-check: a graph is served only if it reproduces the fp32 graph on this machine.

Two things can make a graph compute other numbers than the one that was verified at export:
- **reduced precision**: integer matmul kernels differ between CPUs. onnxruntime's u8s8 kernel on
  AVX2 without VNNI saturates its 16-bit pair sums, so the same INT8 graph is close to fp32 on one
  CPU and further off on another (see docs/onnx.md). Such a graph must agree with the bundle's fp32
  graph, run on the CPU, on the most likely next token at `MIN_AGREEMENT[weights]` of the probe
  positions. The thresholds sit well below what a correct graph of that precision measures and
  well above what a broken one does (docs/onnx.md has both). A graph whose KV cache is kept in fewer
  bytes (float16, int8; docs/engine.md#kv-precision) is held to `MIN_KV_AGREEMENT[cache]` alike.
  Scoring stops as soon as the positions left could no longer bring a graph to its bar, so one that
  fails is refused without running the whole probe.
- **another execution provider** (CUDA): the KV cache is bound in host memory and written in place
  by the attention node, which holds only if onnxruntime places that node where it can write it. An
  fp32 graph there must reproduce the CPU's logits to `LOGIT_TOLERANCE` of the largest logit.

The probe is text the fp32 graph writes itself: `PROBE_ROWS` sequences sampled at temperature 1
with a fixed seed, `PROBE_TOKENS` tokens each, and the logits it sampled them from, at every position (one
decode step per token, each reading the cache the steps before wrote). The graph checked scores the same
sequences the way serving runs a prompt: the first half in one prefill, the rest one decode step at a time
(the part another provider could get wrong). So the reference runs once per probe, however many graphs are
checked against it; its logits differ from what a prefill of the same positions would give by rounding
(about 1e-6), far below anything the check measures. A check costs a few milliseconds for the default model
and leaves no cache attached to either runner.

An encoder-decoder's graphs are probed alike with sources and targets (`seq2seq_check.py`); the probe's size
and what a probe measures are shared by both (`probes.py`).

Every graph, fp32 on the CPU included, is also probed for **batch invariance**: `INVARIANCE_ROWS` rows of
the probe are scored alone, then inside a batch of all the probe's rows, whose prompts have other lengths
(a prefill, then decode steps). Their logits must be the same bits. A graph that fails it gives a request
other tokens depending on what else runs beside it: onnxruntime's dynamic INT8 quantization, which scales
the whole batch's activations by one number, does (docs/onnx.md). `graph_choice` decides what follows.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from service.runtime.bundle import BundleError, GraphSpec
from service.runtime.cpu import cpu_info
from service.runtime.probes import (
    INVARIANCE_ROWS,
    INVARIANCE_STEPS,
    PROBE_ROWS,
    PROBE_SEED,
    PROBE_TOKENS,
    Agreement,
    Invariance,
    Probes,
    sample_tokens,
)
from service.runtime.seq2seq_check import SEQ2SEQ_PROBES
from service.runtime.seq2seq_runner import Seq2SeqRunner
from service.runtime.static_runner import StaticRunner

log = logging.getLogger(__name__)

# least top-1 agreement with fp32 on the probe, by weight precision. Measured on the default model
# (docs/onnx.md): 8-bit formats 0.95-0.996, 4-bit 0.84-0.89 (what --int4 writes: 0.86 with AVX-512 and
# with AVX2 alone); another model's graph far below
MIN_AGREEMENT = {"int8": 0.90, "int4": 0.80, "float16": 0.95}
# least top-1 agreement with fp32 for a KV cache kept in fewer bytes, by its type. Measured on the default model
# (docs/engine.md#kv-precision): float16 100%, int8 99.6%; a graph reduced in both is held to the lower bar
MIN_KV_AGREEMENT = {"float16": 0.98, "int8": 0.95}
LOGIT_TOLERANCE = 1e-2  # of the largest logit: TF32 matmuls on a GPU differ from the CPU in the 3rd digit


@dataclass
class SelfCheck:
    agreement: Agreement | None  # None: the fp32 graph on the CPU, the reference itself
    invariance: Invariance


@dataclass
class Probe:
    seqs: np.ndarray  # [rows, tokens] ids the reference sampled, each row from the start of a document
    logits: np.ndarray  # [rows, tokens, vocab] the reference's logits after each position, as it sampled


def sample_probe(reference: StaticRunner, rows: int = PROBE_ROWS, tokens: int = PROBE_TOKENS,
                 seed: int = PROBE_SEED) -> Probe:
    """The probe: text the reference samples itself, and its logits at every position."""
    m = reference.manifest.model
    tokens = min(tokens, m.n_ctx)
    sampleable = min(reference.tokenizer.vocab_size, m.vocab_size)
    start = m.bos_token_id if m.bos_token_id is not None else m.eos_token_id  # EOS separates documents
    rng = np.random.default_rng(seed)
    with reference.scratch_cache(rows, tokens):
        seqs = np.full((rows, tokens), start, dtype=np.int64)
        logits = np.empty((rows, tokens, reference.vocab_size), dtype=np.float32)
        logits[:, 0] = reference.prefill_batch(0, [[start]] * rows)
        for t in range(1, tokens):
            seqs[:, t] = sample_tokens(logits[:, t - 1, :sampleable], rng)
            logits[:, t] = reference.decode(seqs[:, t], np.full(rows, t))
    return Probe(seqs, logits)


def probe_sequences(reference: StaticRunner, rows: int = PROBE_ROWS, tokens: int = PROBE_TOKENS,
                    seed: int = PROBE_SEED) -> np.ndarray:
    """[rows, tokens] ids the reference samples itself, each row from the start of a document."""
    return sample_probe(reference, rows, tokens, seed).seqs


def logits_at_every_position(runner: StaticRunner, seqs: np.ndarray) -> np.ndarray:
    """[rows, tokens, vocab] logits of `seqs` in one prefill, on a cache of its own."""
    with runner.scratch_cache(len(seqs), seqs.shape[1]):
        return runner.prefill_batch(0, seqs.tolist(), every_position=True).astype(np.float32)


def served_chunks(runner: StaticRunner, seqs: np.ndarray) -> Generator[np.ndarray]:
    """The logits of `seqs` as serving computes them, in the order it does: [rows, tokens // 2, vocab] from a
    prefill of the first half, then [rows, 1, vocab] from each decode step, fed the sequence's own next token
    (teacher forcing)."""
    rows, tokens = seqs.shape
    half = max(tokens // 2, 1)
    with runner.scratch_cache(rows, tokens):
        yield runner.prefill_batch(0, seqs[:, :half].tolist(), every_position=True).astype(np.float32)
        for t in range(half, tokens):
            yield runner.decode(seqs[:, t], np.full(rows, t)).astype(np.float32)[:, None]


def served_logits(runner: StaticRunner, seqs: np.ndarray) -> np.ndarray:
    """[rows, tokens, vocab] logits of `seqs` as serving computes them (`served_chunks`)."""
    return np.concatenate(list(served_chunks(runner, seqs)), axis=1)


def agreement(candidate: StaticRunner, reference: StaticRunner, probe: Probe | None = None,
              least: float | None = None) -> Agreement:
    """How closely `candidate`, scoring the probe as serving runs a prompt, follows the logits `reference`
    sampled it from (`probe`: made already). With `least`, it stops once it can no longer reach that top-1
    agreement (`Agreement.scored`)."""
    probe = sample_probe(reference) if probe is None else probe
    return Agreement.scored(served_chunks(candidate, probe.seqs), probe.logits, least)


def mixed_batch_logits(runner: StaticRunner, seqs: np.ndarray, lengths: list[int], steps: int) -> np.ndarray:
    """[rows, steps + 1, vocab]: row i's prompt seqs[i, :lengths[i]] prefilled with the others (right-padded
    to the longest), then `steps` decode steps, each row fed its own next token at its own position."""
    rows = len(lengths)
    pos = np.array(lengths)
    with runner.scratch_cache(rows, int(pos.max()) + steps):
        out = np.empty((rows, steps + 1, runner.vocab_size), dtype=np.float32)
        out[:, 0] = runner.prefill_batch(0, [seqs[i, :n].tolist() for i, n in enumerate(lengths)])
        for t in range(steps):
            out[:, t + 1] = runner.decode(seqs[np.arange(rows), pos + t], pos + t)
        return out


def batch_invariance(runner: StaticRunner, probe: Probe) -> Invariance:
    """Whether rows `INVARIANCE_ROWS` of the probe get the same logits, bit for bit, alone (batch 1) as in a
    batch of every row of the probe, each prompt of another length."""
    seqs = probe.seqs
    rows, tokens = seqs.shape
    half = max(tokens // 2, 1)
    lengths = [max(half - i, 1) for i in range(rows)]
    steps = min(INVARIANCE_STEPS, tokens - half)
    together = mixed_batch_logits(runner, seqs, lengths, steps)
    probed = sorted({r % rows for r in INVARIANCE_ROWS})
    alone = np.stack([mixed_batch_logits(runner, seqs[r:r + 1], [lengths[r]], steps)[0] for r in probed])
    return Invariance.of(alone, together[probed], rows)


def check(runner: StaticRunner, reference: StaticRunner | None = None, allow_low_agreement: bool = False,
          probe=None) -> SelfCheck:
    """Measure `runner` on this machine: its agreement with the fp32 graph (reduced precision, or another
    provider) and its batch invariance. Raises `BundleError` if it disagrees with fp32, unless
    `allow_low_agreement`, which serves it anyway with a warning. `reference`: the bundle's fp32 static
    graph on the CPU, if already open; `probe`: the probe it made (`probes_for(reference).probe(reference)`),
    if made already, so that graphs checked one after another share it."""
    reduced = least_agreement(runner.spec) is not None
    on_cpu = runner.provider == "CPUExecutionProvider"
    probes = probes_for(runner)
    if not reduced and on_cpu:
        invariance = probes.batch_invariance(runner, probe if probe is not None else probes.probe(runner))
        log.info("self-check: graph %s (fp32 on the CPU, the reference) is %s", runner.graph_name,
                 invariance.describe())
        return SelfCheck(None, invariance)
    reference = reference or open_reference(runner)
    probe = probe if probe is not None else probes.probe(reference)
    result = probes.agreement(runner, reference, probe, least=least_agreement(runner.spec))
    where = f"on {runner.provider}" if not on_cpu else f"on this CPU ({cpu_info().describe()})"
    refusal = _disagreement(runner, reference, result, where)
    if refusal and not allow_low_agreement:
        raise BundleError(refusal)
    if refusal:
        log.warning("serving it anyway (allow_low_agreement): %s", refusal)
    invariance = probes.batch_invariance(runner, probe)
    log.info("self-check: graph %s (%s) %s agrees with fp32 graph %s on the top-1 token at %.1f%% of %d "
             "probe positions (max |Δlogit| %.3g); %s", runner.graph_name, precision(runner.spec), where,
             reference.graph_name, 100 * result.top1, result.positions, result.max_abs_diff, invariance.describe())
    return SelfCheck(result, invariance)


def _disagreement(runner: StaticRunner, reference: StaticRunner, result: Agreement, where: str) -> str | None:
    """Why `runner` may not serve, in one line, or None: a reduced-precision graph below its agreement bar,
    or an fp32 graph on another provider that does not reproduce the CPU."""
    least = least_agreement(runner.spec)
    if least is not None:
        if result.top1 >= least:
            return None
        fix = " --kv-dtype float32" if runner.spec.cache_dtype != "float32" else ""
        if runner.spec.weights != "float32":
            fix += (f", or re-export the bundle with a current 'attnserve export --{_export_flag(runner)}', whose "
                    "weights compute alike on every CPU")
        return (f"graph {runner.graph_name!r} ({precision(runner.spec)}) {where} agrees with the fp32 graph "
                f"{reference.graph_name!r} on the top-1 token at only {result.top1:.1%} of {result.positions} probe "
                f"positions{'' if result.complete else ' scored'} (at least {least:.0%} is required"
                f"{_saturation_note(runner)}{'' if result.complete else '; the rest could no longer reach it'}); "
                f"serve --graph "
                f"{reference.graph_name}{fix}")
    if result.max_abs_diff <= LOGIT_TOLERANCE * result.scale:
        return None
    return (f"graph {runner.graph_name!r} {where} does not reproduce the CPU (largest logit difference "
            f"{result.max_abs_diff:.3g}, allowed {LOGIT_TOLERANCE * result.scale:.3g}); serve it with provider 'cpu'")


def least_agreement(spec: GraphSpec) -> float | None:
    """The top-1 agreement with fp32 a graph must reach: the lower bar of what it keeps in fewer bits (its
    weights, its KV cache), or None for a graph in float32 throughout."""
    bars = [MIN_AGREEMENT.get(spec.weights, 1.0)] if spec.weights != "float32" else []
    bars += [MIN_KV_AGREEMENT.get(spec.cache_dtype, 1.0)] if spec.cache_dtype != "float32" else []
    return min(bars) if bars else None


def precision(spec: GraphSpec) -> str:
    """'int8 weights', or with a KV cache in fewer bytes 'float32 weights, float16 KV cache'."""
    cache = f", {spec.cache_dtype} KV cache" if spec.cache_dtype != "float32" else ""
    return f"{spec.weights} weights{cache}"


def _saturation_note(runner: StaticRunner) -> str:
    on_avx2_alone = runner.provider == "CPUExecutionProvider" and not cpu_info().has_int8_dot
    u8s8 = runner.spec.weights == "int8"  # 4-bit weights times int8 activations fit 16 bits on every kernel
    return "; without VNNI or AMX this CPU's u8s8 products saturate" if on_avx2_alone and u8s8 else ""


def _export_flag(runner: StaticRunner) -> str:
    return {"int4": "int4", "float16": "fp16"}.get(runner.spec.weights, "int8")


def probes_for(runner: StaticRunner) -> Probes:
    return SEQ2SEQ_PROBES if runner.manifest.model.encoder_decoder else DECODER_PROBES


def open_reference(runner: StaticRunner) -> StaticRunner:
    """The bundle's fp32 static graph on the CPU: the graph export verified against PyTorch."""
    for name, spec in runner.manifest.graphs.items():
        if spec.cache == "static" and spec.weights == "float32" and spec.dtype == spec.cache_dtype == "float32":
            if isinstance(runner, Seq2SeqRunner):
                return Seq2SeqRunner(runner.bundle_dir, name, provider="cpu", max_source=runner.max_source)
            return StaticRunner(runner.bundle_dir, name, provider="cpu")
    raise BundleError(f"graph {runner.graph_name!r} cannot be checked: the bundle has no fp32 static graph to "
                      "compare it with; re-export it with a current 'attnserve export'")


DECODER_PROBES = Probes(sample_probe, agreement, batch_invariance)
