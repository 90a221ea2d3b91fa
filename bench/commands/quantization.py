"""`attnserve bench quantization`: which reduced-precision format stays right on every CPU.

    attnserve bench quantization [--bundle models/shakespeare-onnx] [--quick] [--emulate Haswell]
    attnserve bench quantization --gpt2-shape --candidates u8s8-reduce-range,nbits4-int8 --block-sizes 32,64

Every candidate of `export.variants.QUANTIZATIONS` is written from the bundle's fp32 serving graph
and measured against it, on this CPU; each 4-bit one once per block size of `--block-sizes` (named
`nbits4-int8-b64` and so on, as `export.variants.quantization` reads them):
- held-out bits/char: the held-out plays scored as training scores them (`model.training.scoring`);
- greedy agreement: 16 prompts cut from the held-out text, 64 greedy tokens each; how many of the
  continuations are identical to fp32's, and the mean number of tokens before the first difference;
- top-1 agreement on the start-up self-check's probe (`service.runtime.self_check`);
- batch invariance, as the self-check probes it: whether rows' logits are the same bits alone and
  among other rows of other lengths;
- decode step time at batch 1 and 32 against fp32, in interleaved rounds, medians;
- batch 1 against the memory-bandwidth bound: tokens/s, the bytes of weights a step reads
  (`bench.roofline.weight_bytes_per_token`) and the tokens/s this machine's read bandwidth
  (`bench.commands.bandwidth.read_bandwidth`, measured in the same run) allows for them, as a percentage.

`--gpt2-shape` measures speed alone, on random weights of GPT-2 124M's shape (12 layers, 768 wide,
50257 tokens, 1024 context), where batch 1 is bound by reading the weights as in real deployments
and not by per-op overhead as in the 6M default model.

`--real-shape NAME` measures speed alone on a shape of `bench.real_shapes` (built once under ~/.cache, e.g.
qwen2.5-0.5b): the sizes served on CPU, where the 4-bit block size and the bytes read per token decide batch 1.

`--emulate CPU` measures the quality columns again under `qemu-x86_64 -cpu CPU`, where onnxruntime
sees only that CPU's instructions (Haswell: AVX2 without VNNI); emulated times mean nothing and
are left out. Results are kept per CPU in docs/bench/quantization.json: a run adds or replaces
its own CPU's entry, and each CPU gets its own table, never merged with another's, in
docs/BENCHMARKS.md and in docs/onnx.md, where the shipped format is chosen from them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.commands.bandwidth import read_bandwidth
from bench.commands.onnx_variants import held_out_bits_per_char, held_out_ids
from bench.machine import BENCH_DOC, RESULTS_DIR, ROOT, describe, machine_line, publish, shown
from bench.roofline import bound_tokens_per_s, weight_bytes_per_token
from service.engine.config import DEFAULT_BUNDLE
from service.runtime.bundle import read_manifest, write_manifest
from service.runtime.graph_choice import decode_step_ms
from service.runtime.self_check import agreement, batch_invariance, logits_at_every_position, sample_probe
from service.runtime.static_runner import StaticRunner

ONNX_DOC = ROOT / "docs" / "onnx.md"  # the tables also stand where the format is chosen
REFERENCE = "fp32"
BATCHES = (1, 32)
GPT2_SHAPE = dict(vocab_size=50257, n_ctx=1024, n_layer=12, n_head=12, d_model=768)


def candidate_bundle(bundle: Path, out: Path, names: list[str]) -> list[str]:
    """A bundle in `out` holding the fp32 serving graph (as REFERENCE) and each candidate quantisation."""
    from export.external_data import copy_graph
    from export.variants import quantization, quantize

    manifest = read_manifest(bundle)
    name, spec = next((n, s) for n, s in manifest.graphs.items() if s.cache == "static" and s.weights == "float32")
    out.mkdir(parents=True, exist_ok=True)
    copy_graph(bundle / spec.file, out / "fp32.onnx")
    shutil.copyfile(bundle / manifest.tokenizer_file, out / manifest.tokenizer_file)
    graphs = {REFERENCE: spec.model_copy(update={"file": "fp32.onnx"})}
    for q in names:
        quantize(bundle / spec.file, out / f"{q}.onnx", quantization(q))
        graphs[q] = spec.model_copy(update={"file": f"{q}.onnx", "weights": quantization(q).weights,
                                            "description": f"candidate {q}"})
    manifest.graphs, manifest.default_graph = graphs, REFERENCE
    write_manifest(out, manifest)
    return list(graphs)


def greedy(runner: StaticRunner, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    rows, length = prompts.shape
    out = np.zeros((rows, new_tokens), dtype=np.int64)
    with runner.scratch_cache(rows, length + new_tokens):
        logits = runner.prefill_batch(0, prompts.tolist())
        for t in range(new_tokens):
            out[:, t] = logits.argmax(-1)
            if t + 1 < new_tokens:
                logits = runner.decode(out[:, t], np.full(rows, length + t))
    return out


FULL = dict(windows=None, prompts=16, prompt_tokens=16, new_tokens=64)
QUICK = dict(windows=8, prompts=4, prompt_tokens=8, new_tokens=16)
EMULATED = dict(QUICK, windows=4)  # under emulation, which runs 30-100x slower


def measure_quality(bundle: Path, graphs: list[str], threads: int, held_out: tuple[np.ndarray, int],
                    windows: int | None, prompts: int, prompt_tokens: int, new_tokens: int) -> dict[str, dict]:
    """Quality columns of every graph: bits/char over `windows` windows of the held-out ids (None: all
    of them), greedy runs of `new_tokens` from `prompts` prompts cut from them, and the probe."""
    runners = {g: StaticRunner(bundle, g, provider="cpu", intra_op_threads=threads) for g in graphs}
    ref = runners[REFERENCE]
    data, n_ctx = held_out[0], ref.manifest.model.n_ctx
    starts = np.linspace(0, len(data) - prompt_tokens - 1, prompts).astype(int)
    cut = np.stack([data[s:s + prompt_tokens] for s in starts])
    want, probe = greedy(ref, cut, new_tokens), sample_probe(ref)
    rows = {}
    for g, runner in runners.items():
        differs = greedy(runner, cut, new_tokens) != want
        first = np.where(differs.any(1), differs.argmax(1), new_tokens)
        rows[g] = {"bits_per_char": held_out_bits_per_char(partial(logits_at_every_position, runner), held_out, n_ctx,
                                                           windows),
                   "greedy_identical": int((~differs.any(1)).sum()), "greedy_prompts": prompts,
                   "greedy_tokens": new_tokens, "greedy_mean_prefix": float(first.mean()),
                   "probe_top1": agreement(runner, ref, probe).top1}
        print(f"{g:>18}: {json.dumps(rows[g])}", flush=True)
    return rows


def measure_invariance(bundle: Path, graphs: list[str], threads: int) -> dict[str, dict]:
    probe = sample_probe(StaticRunner(bundle, REFERENCE, provider="cpu", intra_op_threads=threads))
    return {g: {"batch_invariant": batch_invariance(StaticRunner(bundle, g, provider="cpu", intra_op_threads=threads),
                                                    probe).identical} for g in graphs}


def measure_speed(bundle: Path, graphs: list[str], quick: bool, threads: int) -> dict[str, dict]:
    runners = {g: StaticRunner(bundle, g, provider="cpu", intra_op_threads=threads) for g in graphs}
    rounds, steps = (1, 3) if quick else (5, 16)
    samples = {(g, b): [] for g in graphs for b in BATCHES}
    for _ in range(rounds):
        for g, runner in runners.items():
            for b in BATCHES:
                samples[g, b] += decode_step_ms(runner, b, steps, prompt_tokens=16)
    return {g: {f"decode_ms_b{b}": statistics.median(samples[g, b]) for b in BATCHES} for g in graphs}


def roofline(bundle: Path, rows: dict[str, dict], gb_per_s: float) -> None:
    """Add each graph's batch-1 tokens/s, its bytes read per token and the bound they give at `gb_per_s`."""
    manifest = read_manifest(bundle)
    for g, row in rows.items():
        row["bytes_per_token"] = weight_bytes_per_token(bundle / manifest.graphs[g].file)
        row["tokens_per_s_b1"] = 1000 / row["decode_ms_b1"]
        row["bound_tokens_per_s"] = bound_tokens_per_s(row["bytes_per_token"], gb_per_s)


def expand_block_sizes(names: list[str], block_sizes: list[int]) -> list[str]:
    """Each 4-bit candidate named without a block size, once per block size."""
    from export.variants import QUANTIZATIONS, quantization

    out = []
    for name in names:
        q = quantization(name)
        sweep = name in QUANTIZATIONS and q.method == "blockwise" and q.bits == 4 and block_sizes
        out += [f"{name}-b{b}" for b in block_sizes] if sweep else [name]
    return out


def emulated_quality(bundle: Path, graphs: list[str], cpu: str, held_out: tuple[np.ndarray, int]) -> dict[str, dict]:
    """measure_quality under `qemu-x86_64 -cpu <cpu>`, in a child process, on the EMULATED subset
    (the held-out ids are handed over: tokenizing under emulation would take minutes)."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise SystemExit("--emulate needs qemu-x86_64 (Debian: apt-get install qemu-user)")
    with tempfile.TemporaryDirectory() as tmp:
        out, ids = Path(tmp) / "quality.json", Path(tmp) / "held_out.npz"
        np.savez(ids, data=held_out[0], chars=held_out[1])
        cmd = [qemu, "-cpu", cpu, sys.executable, "-m", "bench.commands.quantization", "--quality-of", str(bundle),
               "--graphs", ",".join(graphs), "--held-out", str(ids), "--quality-json", str(out), "--threads", "1"]
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    from export.variants import BLOCK_SIZES, INT4, INT8, QUANTIZATIONS

    p = HintingParser(prog="attnserve bench quantization", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    p.add_argument("--candidates", default=",".join(QUANTIZATIONS), help="comma-separated, from export.variants")
    p.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)),
                   help="block sizes each 4-bit candidate is measured at (empty: as named, block 32)")
    p.add_argument("--bandwidth-mb", type=int, default=1000, help="array size of the read-bandwidth probe, MB")
    p.add_argument("--quick", action="store_true", help="a few windows, prompts and steps: checks that it runs")
    p.add_argument("--gpt2-shape", action="store_true", help="speed only, on random weights of GPT-2 124M's shape")
    p.add_argument("--real-shape", metavar="NAME", help="speed only, on this shape of bench.real_shapes (built once)")
    p.add_argument("--emulate", metavar="CPU", help="also measure quality under qemu-x86_64 -cpu CPU (e.g. Haswell)")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = one per core)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    p.add_argument("--quality-of", type=Path, help=argparse.SUPPRESS)  # the emulated child: this bundle's quality
    p.add_argument("--graphs", help=argparse.SUPPRESS)
    p.add_argument("--quality-json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--held-out", type=Path, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv  # the command is recorded with its arguments
    args = p.parse_args(argv)

    if args.quality_of:
        ids = np.load(args.held_out)
        rows = measure_quality(args.quality_of, args.graphs.split(","), args.threads,
                               (ids["data"], int(ids["chars"])), **EMULATED)
        args.quality_json.write_text(json.dumps(rows))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        source = args.bundle
        if args.gpt2_shape:
            from bench.commands.engine import random_bundle

            source = random_bundle(args.bundle, Path(tmp) / "gpt2-shape", **GPT2_SHAPE)
        elif args.real_shape:
            from bench.real_shapes import build

            source = build(args.real_shape).bundle
        speed_only = args.gpt2_shape or args.real_shape
        work = Path(tmp) / "candidates"
        block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
        graphs = candidate_bundle(source, work, expand_block_sizes(args.candidates.split(","), block_sizes))
        held_out = held_out_ids(StaticRunner(work, REFERENCE, provider="cpu").tokenizer)
        rows = {g: {} for g in graphs} if speed_only else measure_quality(
            work, graphs, args.threads, held_out, **(QUICK if args.quick else FULL))
        for measured in (measure_invariance(work, graphs, args.threads),
                         measure_speed(work, graphs, args.quick, args.threads)):
            for g, row in measured.items():
                rows[g].update(row)
        gb_per_s = read_bandwidth(args.bandwidth_mb, 3 if args.quick else 5)
        roofline(work, rows, gb_per_s)
        emulated = emulated_quality(work, graphs, args.emulate, held_out) if args.emulate else None
    machine = describe()
    model = ("random weights, GPT-2 124M shape" if args.gpt2_shape else
             f"random weights, {args.real_shape} shape" if args.real_shape else read_manifest(args.bundle).model.name)
    run = {"machine": machine, "model": model, "quick": args.quick,
           "command": "attnserve bench quantization" + (" " + " ".join(argv) if argv else ""), "rows": rows,
           "read_gb_per_s": gb_per_s, "exported": {"--int8": INT8.name, "--int4": INT4.name},
           "emulated": {"cpu": args.emulate, "rows": emulated} if emulated else None}
    print(render_run(run))
    if args.no_write:
        return 0
    path = args.out / "quantization.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else {}
    runs[f"{machine_line(machine)}; {model}"] = run
    result = {"runs": runs}
    publish("quantization", result, render(result), args.out, docs=(BENCH_DOC, ONNX_DOC))
    return 0


QUALITY = (("held-out bits/char", lambda r, ref: f"{r['bits_per_char']:.4f}"),
           ("Δ vs fp32", lambda r, ref: f"{r['bits_per_char'] - ref['bits_per_char']:+.4f}"),
           ("identical greedy runs", lambda r, ref: f"{r['greedy_identical']}/{r['greedy_prompts']}"),
           ("mean tokens before a difference", lambda r, ref: f"{r['greedy_mean_prefix']:.1f}"),
           ("probe top-1", lambda r, ref: f"{r['probe_top1']:.1%}"))
INVARIANCE = (("batch-invariant", lambda r, ref: "yes" if r["batch_invariant"] else "**no**"),)
SPEED = tuple((f"{label}, batch {b}", fn) for b in BATCHES for label, fn in (
    ("decode ms", lambda r, ref, b=b: f"{r[f'decode_ms_b{b}']:.2f}"),
    ("× fp32", lambda r, ref, b=b: f"{ref[f'decode_ms_b{b}'] / r[f'decode_ms_b{b}']:.2f}×")))
ROOFLINE = (("weights read per token, MB", lambda r, ref: f"{r['bytes_per_token'] / 1e6:.1f}"),
            ("tokens/s, batch 1", lambda r, ref: f"{r['tokens_per_s_b1']:.1f}"),
            ("bandwidth bound, tokens/s", lambda r, ref: f"{r['bound_tokens_per_s']:.1f}"),
            ("% of bound", lambda r, ref: f"{100 * r['tokens_per_s_b1'] / r['bound_tokens_per_s']:.0f}%"))


def table(rows: dict[str, dict], columns, exported: dict[str, str] | None = None) -> list[str]:
    ref = rows[REFERENCE]
    written_by = {name: flag for flag, name in (exported or {}).items()}
    lines = ["| graph | " + " | ".join(label for label, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    return lines + [f"| `{g}`{f' ({written_by[g]})' if g in written_by else ''} | "
                    + " | ".join(fn(r, ref) for _, fn in columns) + " |" for g, r in rows.items()]


def render_run(run: dict) -> str:
    quality = "bits_per_char" in run["rows"][REFERENCE]
    lines = [f"#### {machine_line(run['machine'])}; {run['model']}", "", f"`{shown(run['command'])}`"
             + (" (quick run: a subset, not a measurement)" if run["quick"] else "") + ".", ""]
    invariance = INVARIANCE if "batch_invariant" in run["rows"][REFERENCE] else ()
    lines += table(run["rows"], (QUALITY if quality else ()) + invariance + SPEED, run.get("exported"))
    if "read_gb_per_s" in run:
        lines += ["", f"Batch 1 against the memory-bandwidth bound: read bandwidth {run['read_gb_per_s']:.1f} GB/s "
                      "(`bench.commands.bandwidth.read_bandwidth`, every core, measured in the same run) over the "
                      "bytes of weights a step reads (`bench.roofline.weight_bytes_per_token`: every initializer but "
                      "the gathered embeddings and rotary tables).", ""]
        lines += table(run["rows"], ROOFLINE, run.get("exported"))
    if run.get("emulated"):
        em = run["emulated"]
        lines += ["", f"The same graphs under `qemu-x86_64 -cpu {em['cpu']}` on this machine (quality only, on a "
                      f"subset: bits/char on {EMULATED['windows']} held-out windows against fp32 on the same windows, "
                      f"{EMULATED['prompts']} greedy runs of {EMULATED['new_tokens']} tokens):", ""]
        lines += table(em["rows"], QUALITY)
    return "\n".join(lines) + "\n"


def render(result: dict) -> str:
    lines = ["### Reduced-precision candidates, per CPU", "",
             "Each CPU's figures stand alone: times from different CPUs are not comparable. Greedy: 16 prompts "
             "from the held-out text, 64 tokens each, against the fp32 graph. Probe top-1: what the start-up "
             "self-check measures (`service/runtime/self_check.py`).", ""]
    for run in result["runs"].values():
        lines += [render_run(run), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
