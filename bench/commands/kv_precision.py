"""`attnserve bench kv-precision`: the KV cache in float32, float16 or int8, on this CPU.

    attnserve bench kv-precision                       # the attention op at a real shape, then the shipped model
    attnserve bench kv-precision --no-model            # the op alone
    attnserve bench kv-precision --heads 4 --kv-heads 2 --contexts 64 --batches 1,2 --prefill 32 --rounds 1 --quick

**The op** (`export.kv_precision.with_kv_cache` applied to one `GroupQueryAttention` layer; by default
Qwen2.5-0.5B's attention: 14 query heads, 2 KV heads of 64; no rotary), past and present bound to one
buffer as the serving runner binds them:
- whether onnxruntime accepts each cache type on the CPU and writes it in place;
- exactness: one decode step at batch 8 over random keys and values, against float64 attention over
  the float32 values (what the cache would hold at full precision), as the largest |Δ| over the largest
  |output|; and whether the kernel's new keys and values are read back from the cache as rounded (int8);
- stability: the same step run twice gives the same bits; a row alone gives the bits it gets in the batch;
- speed: a decode step at each batch of `--batches` and context of `--contexts`, a prefill of `--prefill`
  tokens at batch 1; rounds interleaved across cache types, medians.

**The model** (`--bundle`, default the shipped one): its fp32 serving graph against its float16- and
int8-cache twins (`export.kv_precision`): bits/char on the held-out plays with every position scored by a
decode step that reads the cache (the cache's effect in full; a whole-window prefill would read its own
keys and values at the op's input precision), greedy top-1 agreement at those positions, the start-up
self-check's agreement and batch-invariance probe, and bytes per token per layer.

Writes docs/bench/kv_precision.json (or into --out) and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from export.external_data import copy_graph

DTYPES = ("float32", "float16", "int8")
NUMPY = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


# ---------------------------------------------------------------- the op

def op_graph(heads: int, kv_heads: int, d_head: int, dtype: str, scales: tuple[np.ndarray, np.ndarray] | None):
    """One GroupQueryAttention over packed QKV [batch, seq, (heads + 2 kv_heads) d_head], its cache in `dtype`."""
    from onnx import TensorProto, helper

    from export.kv_precision import with_kv_cache

    cache = ["batch", kv_heads, "max_seq", d_head]
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length"], ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, scale=d_head ** -0.5)
    graph = helper.make_graph(
        [node], "kv_precision_op",
        [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["batch", "seq", (heads + 2 * kv_heads) * d_head]),
         helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
         helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", heads * d_head]),
         helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return with_kv_cache(model, dtype, [scales] if scales is not None else None)


class Op:
    """The op's session and a cache of its own, bound as past and present."""

    def __init__(self, heads: int, kv_heads: int, d_head: int, dtype: str, scales, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(op_graph(heads, kv_heads, d_head, dtype, scales).SerializeToString(),
                                            options, providers=["CPUExecutionProvider"])
        self.shape, self.dtype, self.scales = (heads, kv_heads, d_head), dtype, scales
        self.key = self.value = None

    def fill(self, key: np.ndarray, value: np.ndarray) -> None:
        """Take float32 keys and values [batch, kv_heads, max_seq, d_head] as the cache, in its own type."""
        self.key, self.value = self.store(key, 0), self.store(value, 1)

    def store(self, x: np.ndarray, which: int) -> np.ndarray:
        if self.dtype == "int8":
            scale = self.scales[which][None, :, None, :]
            return np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
        return np.ascontiguousarray(x.astype(NUMPY[self.dtype]))

    def read(self, which: int) -> np.ndarray:
        """The cache as float32 values (int8 dequantized)."""
        x = (self.key, self.value)[which].astype(np.float32)
        return x * self.scales[which][None, :, None, :] if self.dtype == "int8" else x

    def run(self, qkv: np.ndarray, seqlens: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
        import onnxruntime as ort

        binding = self.session.io_binding()
        binding.bind_cpu_input("qkv", qkv)
        binding.bind_cpu_input("seqlens_k", seqlens.astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(int(seqlens.max()) + 1, dtype=np.int32))
        binding.bind_output("out", "cpu")
        for past, present, buf in (("past_key", "present_key", self.key), ("past_value", "present_value", self.value)):
            view = ort.OrtValue.ortvalue_from_numpy(buf[rows])
            binding.bind_ortvalue_input(past, view)
            binding.bind_ortvalue_output(present, view)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()


def attention(q: np.ndarray, key: np.ndarray, value: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """float64 causal attention of q [batch, heads, seq, d_head], the last `seq` of each row's `lengths` positions,
    over that row's keys and values [batch, kv_heads, >= length, d_head]."""
    heads, kv_heads, seq = q.shape[1], key.shape[1], q.shape[2]
    out = np.zeros(q.shape)
    for b, n in enumerate(lengths):
        for h in range(heads):
            k, v = key[b, h // (heads // kv_heads), :n].astype(np.float64), value[b, h // (heads // kv_heads), :n]
            s = q[b, h].astype(np.float64) @ k.T / np.sqrt(q.shape[-1])  # (seq, n)
            s[np.arange(n)[None, :] > np.arange(n - seq, n)[:, None]] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, h] = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    return out


def split_qkv(qkv: np.ndarray, heads: int, kv_heads: int, d_head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed [batch, seq, (heads + 2 kv_heads) d] -> q [batch, heads, seq, d], k and v [batch, kv_heads, seq, d]."""
    b, s, _ = qkv.shape
    x = qkv.reshape(b, s, heads + 2 * kv_heads, d_head).transpose(0, 2, 1, 3)
    return x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]


def op_exactness(heads: int, kv_heads: int, d_head: int, context: int, threads: int, batch: int = 8,
                 prompt: int = 48) -> dict:
    """Per cache type: accepted; a decode step at `batch` rows of other lengths over random keys and values, and
    a prefill of `prompt` tokens at batch 2, each against float64 attention at full precision and over the values
    the op holds (its cache as stored; its query and output in its own type); for int8, whether the step's own
    keys and values are read back from the cache (rounded) or as they came in; the same bits twice and alone."""
    from export.kv_precision import scales_of

    rng = np.random.default_rng(0)
    lengths = np.linspace(context // 4, context, batch).astype(int)  # each row's length, its new token included
    key = rng.standard_normal((batch, kv_heads, context, d_head)).astype(np.float32)
    value = rng.standard_normal(key.shape).astype(np.float32)
    width = (heads + 2 * kv_heads) * d_head
    qkv = rng.standard_normal((batch, 1, width)).astype(np.float32)
    prompts = rng.standard_normal((2, prompt, width)).astype(np.float32)
    q, new_k, new_v = split_qkv(qkv, heads, kv_heads, d_head)
    last = (np.arange(batch), slice(None), lengths - 1)
    full_k, full_v = key.copy(), value.copy()
    full_k[last], full_v[last] = new_k[:, :, 0], new_v[:, :, 0]
    largest = tuple(np.maximum(np.abs(x).max(axis=(0, 2)), np.abs(p).max(axis=(0, 2)))
                    for x, p in zip((full_k, full_v), split_qkv(prompts, heads, kv_heads, d_head)[1:], strict=True))
    rows = {}
    for dtype in DTYPES:
        try:
            op = Op(heads, kv_heads, d_head, dtype, tuple(scales_of(x) for x in largest), threads)
        except Exception as e:  # onnxruntime refuses the graph: say why
            rows[dtype] = {"accepted": False, "error": " ".join(str(e).split())[:300]}
            continue
        row = {"accepted": True}
        for call, x, past, n in (("decode", qkv, (key, value), lengths),
                                 ("prefill", prompts, None, np.full(2, prompt))):
            cache = past or (np.zeros((2, kv_heads, prompt, d_head), np.float32),) * 2
            op.fill(*cache)
            got = op.run(x, n - 1)
            rounds = op.read(0), op.read(1)
            op.fill(*cache)
            again = op.run(x, n - 1)
            op.fill(*cache)
            alone = op.run(x[:1], n[:1] - 1, rows=slice(0, 1))
            q, k, v = split_qkv(x, heads, kv_heads, d_head)
            fresh = [c.copy() for c in (past or cache)]
            for buf, new in zip(fresh, (k, v), strict=True):
                for b, length in enumerate(n):
                    buf[b, :, length - x.shape[1]:length] = new[b]
            want = attention(q, *fresh, n)
            scale = np.abs(want).max()
            seen = q.astype(np.float16) if dtype == "float16" else q  # the query as the op computes with it
            stored = attention(seen, *rounds, n)
            stored_fresh = [c.copy() for c in rounds]
            for buf, new in zip(stored_fresh, (k, v), strict=True):
                for b, length in enumerate(n):
                    buf[b, :, length - x.shape[1]:length] = new[b].astype(np.float16) if dtype == "float16" else new[b]
            mixed = attention(seen, *stored_fresh, n)
            if dtype == "float16":  # the op's output is float16, cast back
                stored, mixed = stored.astype(np.float16), mixed.astype(np.float16)
            heads_first = got.reshape(len(n), x.shape[1], heads, d_head).transpose(0, 2, 1, 3)
            row[call] = {"max_err_vs_float64": float(np.abs(heads_first - want).max() / scale),
                         "max_err_vs_its_values": float(np.abs(heads_first - stored).max() / scale),
                         "max_err_vs_fresh_new_kv": float(np.abs(heads_first - mixed).max() / scale),
                         "same_bits_twice": bool(np.array_equal(got, again)),
                         "same_bits_alone": bool(np.array_equal(got[:1], alone))}
        print(f"op {dtype}: {row}", flush=True)
        rows[dtype] = row
    return rows


def op_speed(heads: int, kv_heads: int, d_head: int, batches: list[int], contexts: list[int], prefill: int,
             rounds: int, steps: int, threads: int, dtypes: list[str]) -> list[dict]:
    """Median ms of a decode step (each batch x context) and of a prefill, per cache type, rounds interleaved."""
    rng = np.random.default_rng(1)
    ones = (np.ones((kv_heads, d_head), np.float32) * 4 / 127,) * 2
    ops = {d: Op(heads, kv_heads, d_head, d, ones, threads) for d in dtypes}
    width = (heads + 2 * kv_heads) * d_head
    cases = [("decode", b, c) for c in contexts for b in batches] + ([("prefill", 1, prefill)] if prefill else [])
    samples: dict[tuple, list[float]] = {(d, *case): [] for d in dtypes for case in cases}
    for _ in range(rounds):
        for case in cases:
            kind, batch, context = case
            seq = 1 if kind == "decode" else context
            kv = rng.standard_normal((batch, kv_heads, context + 1, d_head)).astype(np.float32)
            qkv = rng.standard_normal((batch, seq, width)).astype(np.float32)
            seqlens = np.full(batch, context - 1 if kind == "prefill" else context)
            for d, op in ops.items():
                op.fill(kv, kv)
                op.run(qkv, seqlens)  # warm-up at this shape
                for _ in range(steps if kind == "decode" else max(steps // 4, 1)):
                    started = time.perf_counter()
                    op.run(qkv, seqlens)
                    samples[(d, *case)].append(1000 * (time.perf_counter() - started))
            del kv
        for op in ops.values():
            op.key = op.value = None
    return [{"dtype": d, "kind": kind, "batch": b, "context": c, "ms": statistics.median(samples[d, kind, b, c])}
            for (d, kind, b, c) in samples]


# ---------------------------------------------------------------- the model

def kv_bundle(bundle: Path, out: Path) -> dict[str, str]:
    """A bundle in `out` holding `bundle`'s fp32 serving graph and its float16- and int8-cache twins, as
    `attnserve export --kv-dtype` writes them. Returns {cache type: graph name}."""
    import shutil

    import onnx

    from export.bundle_writer import GRAPH_FILES, kv_variant, static_graph_spec
    from export.kv_precision import CALIBRATION_TOKENS, kv_scales, with_kv_cache
    from service.runtime.bundle import read_manifest, write_manifest
    from service.runtime.tokenizer import Tokenizer

    manifest = read_manifest(bundle)
    m = manifest.model
    name, spec = next((n, s) for n, s in manifest.graphs.items()
                      if s.cache == "static" and s.weights == "float32" and s.cache_dtype == "float32")
    out.mkdir(parents=True, exist_ok=True)
    static = out / GRAPH_FILES["static"]
    copy_graph(bundle / spec.file, static)  # with its weights' data file, if it keeps one
    shutil.copyfile(bundle / manifest.tokenizer_file, out / manifest.tokenizer_file)
    vocab = min(Tokenizer.from_file(out / manifest.tokenizer_file).vocab_size, m.vocab_size)
    start = m.bos_token_id if m.bos_token_id is not None else m.eos_token_id
    scales = kv_scales(static, m.n_layer, min(m.n_ctx, CALIBRATION_TOKENS), start, vocab)
    graphs = {"float32": "static"}
    manifest.graphs = {"static": spec.model_copy(update={"file": static.name})}
    for kv in ("float16", "int8"):
        twin = graphs[kv] = kv_variant("static", kv)
        onnx.save(with_kv_cache(onnx.load(str(static)), kv, scales), str(out / GRAPH_FILES[twin]))
        manifest.graphs[twin] = static_graph_spec(twin, m.n_layer)
    manifest.default_graph = "static"
    write_manifest(out, manifest)
    return graphs


def decoded_logits(runner, x: np.ndarray) -> np.ndarray:
    """[rows, n, vocab] logits of windows `x` [rows, n]: position 0 prefilled, every later one computed by a
    decode step that reads the keys and values the steps before it wrote."""
    rows, n = x.shape
    with runner.scratch_cache(rows, n):
        out = np.empty((rows, n, runner.vocab_size), dtype=np.float32)
        out[:, 0] = runner.prefill_batch(0, x[:, :1].tolist())
        for t in range(1, n):
            out[:, t] = runner.decode(x[:, t], np.full(rows, t))
        return out


def model_quality(bundle: Path, graphs: dict[str, str], threads: int, windows: int | None, prompts: int,
                  new_tokens: int) -> dict[str, dict]:
    """Per cache type: held-out bits/char and top-1 agreement with the float32 cache over every scored position
    (decoded, `decoded_logits`), identical greedy continuations, the self-check's probe agreement and
    batch-invariance verdict."""
    from bench.commands.onnx_variants import held_out_ids
    from bench.commands.quantization import greedy
    from model.training.scoring import bits_per_char, eval_batches, nll_sum
    from service.runtime.self_check import agreement, batch_invariance, sample_probe
    from service.runtime.static_runner import StaticRunner

    runners = {kv: StaticRunner(bundle, g, provider="cpu", intra_op_threads=threads) for kv, g in graphs.items()}
    ref = runners["float32"]
    data, chars = held_out_ids(ref.tokenizer)
    nll, same, count = dict.fromkeys(runners, 0.0), dict.fromkeys(runners, 0), 0
    for x, y in eval_batches(data, ref.manifest.model.n_ctx, windows):
        want = decoded_logits(ref, x)
        for kv, runner in runners.items():
            got = want if runner is ref else decoded_logits(runner, x)
            nll[kv] += nll_sum(got, y)
            same[kv] += int((got.argmax(-1) == want.argmax(-1)).sum())
        count += y.size
    starts = np.linspace(0, len(data) - 17, prompts).astype(int)
    cut = np.stack([data[s:s + 16] for s in starts])
    greedy_ref, probe = greedy(ref, cut, new_tokens), sample_probe(ref)
    rows = {}
    for kv, runner in runners.items():
        probed = agreement(runner, ref, probe)
        rows[kv] = {"graph": graphs[kv], "bits_per_char": bits_per_char(nll[kv] / count, count,
                                                                         round(chars * count / (len(data) - 1))),
                    "top1_agreement": same[kv] / count, "positions": count,
                    "greedy_identical": int((greedy(runner, cut, new_tokens) == greedy_ref).all(1).sum()),
                    "greedy_prompts": prompts, "greedy_tokens": new_tokens,
                    "probe_top1": probed.top1, "probe_max_abs_diff": probed.max_abs_diff,
                    "batch_invariant": batch_invariance(runner, probe).identical,
                    "bytes_per_token_per_layer": runner.cache_shape.bytes_per_slot // runner.cache_shape.max_seq
                    // runner.cache_shape.n_layer}
        print(f"model {kv}: {rows[kv]}", flush=True)
    return rows


def model_speed(bundle: Path, graphs: dict[str, str], threads: int, rounds: int, steps: int,
                batches: tuple[int, ...] = (1, 32)) -> dict[str, dict]:
    """Median decode step ms per cache type at each of `batches`, after a prompt filling most of the context."""
    from service.runtime.graph_choice import decode_step_ms
    from service.runtime.static_runner import StaticRunner

    runners = {kv: StaticRunner(bundle, g, provider="cpu", intra_op_threads=threads) for kv, g in graphs.items()}
    prompt = runners["float32"].manifest.model.n_ctx - steps - 2
    samples = {(kv, b): [] for kv in runners for b in batches}
    for _ in range(rounds):
        for kv, runner in runners.items():
            for b in batches:
                samples[kv, b] += decode_step_ms(runner, b, steps, prompt_tokens=prompt)
    return {kv: {"prompt_tokens": prompt, **{f"decode_ms_b{b}": statistics.median(samples[kv, b]) for b in batches}}
            for kv in runners}


def bytes_per_token_per_layer(kv_heads: int, d_head: int, dtype: str) -> int:
    return 2 * kv_heads * d_head * np.dtype(NUMPY[dtype]).itemsize


# ---------------------------------------------------------------- report

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = HintingParser(prog="attnserve bench kv-precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--d-head", type=int, default=64)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens timed at batch 1 (0: none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="decode steps per timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bundle", type=Path, default=None, help="the model measured (default: the shipped one)")
    p.add_argument("--no-model", action="store_true", help="measure the op alone")
    p.add_argument("--windows", type=int, default=None, help="held-out windows scored (default: all of them)")
    p.add_argument("--quick", action="store_true", help="the model on a few windows, prompts and steps")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    shape = {"heads": args.heads, "kv_heads": args.kv_heads, "d_head": args.d_head}
    batches, contexts = [int(x) for x in args.batches.split(",")], [int(x) for x in args.contexts.split(",")]
    load = [round(x, 1) for x in os.getloadavg()]  # other jobs on a shared machine slow every row of a round alike
    exact = op_exactness(**shape, context=min(contexts), threads=args.threads)
    accepted = [d for d in DTYPES if exact[d]["accepted"]]
    speed = op_speed(**shape, batches=batches, contexts=contexts, prefill=args.prefill, rounds=args.rounds,
                     steps=args.steps, threads=args.threads, dtypes=accepted)
    for row in speed:
        print(f"op {row['dtype']:>8} {row['kind']:>7} batch {row['batch']:>2} context {row['context']:>5}: "
              f"{row['ms']:8.3f} ms", flush=True)
    sizes = {d: bytes_per_token_per_layer(args.kv_heads, args.d_head, d) for d in DTYPES}
    result = {"machine": describe(), "load_average": [load, [round(x, 1) for x in os.getloadavg()]],
              "op": {"shape": shape, "exactness": exact, "speed": speed, "bytes_per_token_per_layer": sizes}}
    if not args.no_model:
        import tempfile

        from service.engine.config import DEFAULT_BUNDLE
        from service.runtime.bundle import read_manifest

        bundle = args.bundle or DEFAULT_BUNDLE
        with tempfile.TemporaryDirectory() as tmp:
            graphs = kv_bundle(bundle, Path(tmp))
            quick = dict(windows=args.windows or 4, prompts=4, new_tokens=16) if args.quick else \
                dict(windows=args.windows, prompts=16, new_tokens=64)
            rows = model_quality(Path(tmp), graphs, args.threads, **quick)
            for kv, row in model_speed(Path(tmp), graphs, args.threads, 1 if args.quick else args.rounds,
                                       3 if args.quick else args.steps).items():
                rows[kv].update(row)
        result["model"] = {"name": read_manifest(bundle).model.name, "rows": rows}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        publish("kv_precision", result, md, args.out)
    return 0


def render(r: dict, argv: list[str]) -> str:
    op = r["op"]
    s = op["shape"]
    cmd = shown("attnserve bench kv-precision" + (" " + " ".join(argv) if argv else ""))
    (start, _, _), (end, _, _) = r["load_average"]
    lines = ["## KV cache precision", "", f"`{cmd}` on {machine_line(r['machine'])}; load average {start} at the "
             f"start, {end} at the end (other jobs on the machine: times are noisy, read the ratios).", "",
             f"The op: one `GroupQueryAttention`, {s['heads']} query heads, {s['kv_heads']} KV heads of {s['d_head']}, "
             "past and present bound to one buffer. Errors are relative to the largest |output|: a decode step at "
             "batch 8 (rows of other lengths) over random keys and values, and a prefill at batch 2, against float64 "
             "attention over the float32 values (\"vs exact\") and over the values the op holds (\"vs its "
             "values\": the cache as stored, the query and output in the op's type). \"Reads its new K/V\": whether a "
             "call's own keys and values are read back from the cache as rounded, or as they came in (decode/prefill; "
             "n/a: the op's inputs are already of the cache's type).", "",
             "| cache | bytes/token/layer | accepted | decode vs exact | decode vs its values | prefill vs exact | "
             "prefill vs its values | reads its new K/V | same bits twice | alone = in batch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for d, e in op["exactness"].items():
        size = op["bytes_per_token_per_layer"][d]
        if not e["accepted"]:
            lines.append(f"| {d} | {size} | no: {e['error']} | | | | | | | |")
            continue
        dec, pre = e["decode"], e["prefill"]
        read = "/".join("rounded" if c["max_err_vs_its_values"] <= c["max_err_vs_fresh_new_kv"] else "as they came"
                        for c in (dec, pre)) if d == "int8" else "n/a"
        twice = all(c["same_bits_twice"] for c in (dec, pre))
        alone = all(c["same_bits_alone"] for c in (dec, pre))
        lines.append(f"| {d} | {size} | yes | {dec['max_err_vs_float64']:.1e} | {dec['max_err_vs_its_values']:.1e} | "
                     f"{pre['max_err_vs_float64']:.1e} | {pre['max_err_vs_its_values']:.1e} | {read} | "
                     f"{'yes' if twice else 'no'} | {'yes' if alone else 'no'} |")
    cases = sorted({(row["kind"], row["batch"], row["context"]) for row in op["speed"]},
                   key=lambda c: (c[0] != "decode", c[2], c[1]))
    dtypes = list(dict.fromkeys(row["dtype"] for row in op["speed"]))
    ms = {(row["dtype"], row["kind"], row["batch"], row["context"]): row["ms"] for row in op["speed"]}
    lines += ["", "ms per call, medians of interleaved rounds (× float32 in brackets):", "",
              "| call | " + " | ".join(dtypes) + " |", "|---" * (len(dtypes) + 1) + "|"]
    for kind, b, c in cases:
        base = ms["float32", kind, b, c]
        cells = [f"{ms[d, kind, b, c]:.3f}" + ("" if d == "float32" else f" ({ms[d, kind, b, c] / base:.2f}×)")
                 for d in dtypes]
        what = f"decode, batch {b}, context {c}" if kind == "decode" else f"prefill {c} tokens, batch {b}"
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    if "model" in r:
        lines += render_model(r["model"])
    return "\n".join(lines) + "\n"


def render_model(model: dict) -> list[str]:
    rows = model["rows"]
    ref = rows["float32"]
    first = next(iter(rows.values()))
    return ["", f"The model `{model['name']}`: its fp32 serving graph and the same graph with its KV cache in float16 "
            f"and in int8 (`attnserve export --kv-dtype`). Bits/char and top-1 agreement over {first['positions']} "
            "held-out positions, each scored by a decode step that reads the cache (position 0 by a prefill); "
            f"greedy continuations of {first['greedy_tokens']} tokens from {first['greedy_prompts']} held-out "
            "prompts identical to the float32 cache's; the start-up self-check's probe (top-1 agreement, largest "
            f"|Δlogit|) and its batch-invariance verdict; decode step ms after a {first['prompt_tokens']}-token "
            "prompt.", "",
            "| KV cache | graph | bytes/token/layer | held-out bits/char | Δ vs float32 | top-1 agreement | "
            "identical greedy | probe top-1 | probe max \\|Δlogit\\| | batch-invariant | ms, batch 1 | ms, batch 32 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"] + [
        f"| {kv} | `{row['graph']}` | {row['bytes_per_token_per_layer']} | {row['bits_per_char']:.4f} | "
        f"{row['bits_per_char'] - ref['bits_per_char']:+.5f} | {row['top1_agreement']:.2%} | "
        f"{row['greedy_identical']}/{row['greedy_prompts']} | {row['probe_top1']:.1%} | "
        f"{row['probe_max_abs_diff']:.3g} | "
        f"{'yes' if row['batch_invariant'] else 'no'} | {row['decode_ms_b1']:.2f} | {row['decode_ms_b32']:.2f} |"
        for kv, row in rows.items()]


if __name__ == "__main__":
    raise SystemExit(main())
