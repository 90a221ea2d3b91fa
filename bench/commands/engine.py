"""`attnserve bench engine`: the engine in-process, with no gRPC in the way.

    attnserve bench engine [--bundle models/shakespeare-onnx] [--graphs static,static-int8] [--concurrency 1,8,32,64]
    attnserve bench engine --concurrency 1,2 --new-tokens 4 --repeats 1 --contexts 16,32 --no-write   # seconds

Three measurements in one run:
1. throughput: `c` requests of 16 random prompt tokens submitted at once, 128 greedy new tokens
   each (ignore_eos), for each concurrency c and each serving graph (--graphs, default every
   static-cache graph of the bundle); generated tokens / wall time, median of --repeats;
2. decode step time at batch 32 against context length (64, 256, 512, 1024), on an fp32 graph of
   the same shape with random weights and a 1024-token context (the default model's is shorter);
3. the fraction of the matmul ceiling: tokens/s x 2 x matmul parameters against the GFLOP/s of an
   fp32 1024x1024 matmul measured in the same run;
4. the sampler's share of a decode step at a large vocabulary (--sampler-vocab, default 50257, GPT-2's),
   on a random-weight model of the bundle's shape with that vocabulary: greedy, sampled (temperature
   0.8, top-p 0.95), and sampled with logprobs (top 5), at batch 1 and 32.

Writes docs/bench/engine.json (or into --out) and the engine section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from service.engine.config import DEFAULT_BUNDLE, EngineConfig
from service.engine.core import Engine
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.runtime.bundle import read_manifest


def matmul_gflops(n: int = 1024, repeats: int = 30) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def matmul_params(manifest) -> int:
    """Weights that take part in a matmul per token: the blocks and the output head."""
    m = manifest.model
    d_ff = 4 * m.d_model  # the exported models use the GPT-2 width
    per_layer = 3 * m.d_model * m.d_model + m.d_model * m.d_model + 2 * m.d_model * d_ff
    return m.n_layer * per_layer + m.vocab_size * m.d_model


def throughput(engine: Engine, concurrency: int, prompt_tokens: int, new_tokens: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    vocab = engine.model.vocab_size
    start = time.perf_counter()
    done = engine.generate([GenerationRequest(f"b{seed}-{i}", rng.integers(1, vocab, prompt_tokens).tolist(),
                                              SamplingParams(temperature=0.0),
                                              StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
                            for i in range(concurrency)])
    elapsed = time.perf_counter() - start
    generated = sum(len(result.events) for result in done)
    assert generated == concurrency * new_tokens, (generated, concurrency * new_tokens)
    return generated / elapsed


def random_bundle(bundle: Path, out: Path, **shape) -> Path:
    """A random-weight model of the bundle's shape, changed by `shape` (GPTConfig fields such as n_ctx,
    n_layer, d_model, vocab_size), as one fp32 static-cache graph named "static", with the bundle's
    tokenizer (needs torch). For speed only: its text means nothing."""
    import shutil

    from export.bundle_writer import static_graph_spec
    from export.static_cache_graph import export_static_cache_decoder
    from model.config import GPTConfig
    from model.gpt import GPT
    from service.runtime.bundle import write_manifest

    manifest = read_manifest(bundle)
    m = manifest.model
    fields = dict(vocab_size=m.vocab_size, n_ctx=m.n_ctx, n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model)
    fields.update(shape)
    model = GPT(GPTConfig(**fields))
    spec = static_graph_spec("static", model.config.n_layer)
    out.mkdir(parents=True, exist_ok=True)
    export_static_cache_decoder(model, out / spec.file)
    shutil.copyfile(bundle / manifest.tokenizer_file, out / manifest.tokenizer_file)
    c = model.config
    manifest.model = manifest.model.model_copy(update=dict(vocab_size=c.vocab_size, n_ctx=c.n_ctx, n_layer=c.n_layer,
                                                           n_head=c.n_head, d_model=c.d_model, d_head=c.d_head,
                                                           n_kv_head=c.kv_heads, architecture="gpt2"))
    manifest.graphs = {"static": spec}
    manifest.default_graph = "static"
    write_manifest(out, manifest)
    return out


def decode_step_ms(bundle: Path, contexts: list[int], batch: int, steps: int, threads: int) -> dict[int, float]:
    from service.runtime.static_runner import StaticRunner

    runner = StaticRunner(bundle, provider="cpu", intra_op_threads=threads)
    runner.attach(runner.cache_shape.buffers(batch))
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    result = {}
    for ctx in contexts:
        for first in range(0, batch, 4):  # fill every slot to `ctx` positions
            prompts = [rng.integers(0, vocab, ctx - 8).tolist() for _ in range(min(4, batch - first))]
            runner.prefill_batch(first, prompts)
        times = []
        for step in range(steps):
            ids = rng.integers(0, vocab, batch)
            pos = np.full(batch, ctx - 8 + step % 8)
            t = time.perf_counter()
            runner.decode(ids, pos)
            times.append(time.perf_counter() - t)
        result[ctx] = statistics.median(times[5:]) * 1e3
    return result


SAMPLER_WORKLOADS = {
    "greedy": dict(sampling=dict(temperature=0.0)),
    "top-p 0.95, T 0.8": dict(sampling=dict(temperature=0.8, top_p=0.95)),
    "top-p + top-5 logprobs": dict(sampling=dict(temperature=0.8, top_p=0.95), top_logprobs=5),
}


def sampler_share(bundle: Path, batches: list[int], steps: int, threads: int) -> list[dict]:
    """Median decode step time and the part of it spent sampling, per workload and batch size."""
    import service.engine.sample_step as sample_step

    spent: list[float] = []
    original = sample_step.sample

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        spent.append(time.perf_counter() - t)
        return out

    sample_step.sample = timed
    try:
        engine = Engine(EngineConfig(bundle=bundle, graph="static", max_running=max(batches), threads=threads,
                                     max_batch_tokens=max(512, max(batches) * 9)))
        engine.warm_up()
        rng = np.random.default_rng(0)
        rows = []
        for name, workload in SAMPLER_WORKLOADS.items():
            for batch in batches:
                for i in range(batch):
                    request = GenerationRequest(f"{name}-{batch}-{i}", rng.integers(1, 1000, 8).tolist(),
                                                SamplingParams(seed=i, **workload["sampling"]),
                                                StoppingCriteria(max_new_tokens=steps + 1, ignore_eos=True),
                                                top_logprobs=workload.get("top_logprobs", 0))
                    engine.add(engine.new_request(request))
                engine.step()  # the prefill
                step_times, sample_times = [], []
                while engine.has_work:
                    spent.clear()
                    t = time.perf_counter()
                    engine.step()
                    step_times.append(time.perf_counter() - t)
                    sample_times.append(sum(spent))
                step_ms, sample_ms = statistics.median(step_times) * 1e3, statistics.median(sample_times) * 1e3
                rows.append({"workload": name, "batch": batch, "step_ms": step_ms, "sample_ms": sample_ms,
                             "share": sample_ms / step_ms})
                print(f"vocab {engine.model.vocab_size}, {name:<24} batch {batch:>2}: step {step_ms:6.2f} ms, "
                      f"sampling {sample_ms:5.2f} ms ({sample_ms / step_ms:.0%})")
        return rows
    finally:
        sample_step.sample = original


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    p.add_argument("--graphs", help="serving graphs to measure, comma-separated (default: every static-cache "
                                    "graph of the bundle)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contexts", default="64,256,512,1024")
    p.add_argument("--sampler-vocab", type=int, default=50257, help="vocabulary of the sampler-share model")
    p.add_argument("--sampler-steps", type=int, default=48, help="decode steps per sampler-share row")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = one per core)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    graphs = args.graphs.split(",") if args.graphs else [
        name for name, spec in read_manifest(args.bundle).graphs.items() if spec.cache == "static"]
    if not graphs:
        p.error(f"{args.bundle} has no static-cache graph to serve")

    machine = describe()
    ceiling = matmul_gflops()
    rows = []
    for graph in graphs:
        config = EngineConfig(bundle=args.bundle, graph=graph, max_running=max(levels), threads=args.threads,
                              max_batch_tokens=max(512, max(levels) * (args.prompt_tokens + 1)))
        engine = Engine(config)
        flops_per_token = 2 * matmul_params(engine.runner.manifest)
        engine.warm_up()
        throughput(engine, 2, args.prompt_tokens, 8, seed=99)  # warm-up
        for c in levels:
            runs = [throughput(engine, c, args.prompt_tokens, args.new_tokens, seed=r) for r in range(args.repeats)]
            tps = statistics.median(runs)
            rows.append({"graph": graph, "concurrency": c, "tokens_per_s": tps, "runs": runs,
                         "ceiling_fraction": tps * flops_per_token / (ceiling * 1e9)})
            print(f"{graph} concurrency {c:>3}: {tps:8.0f} tok/s  ({rows[-1]['ceiling_fraction']:.1%} of the ceiling)")
        del engine

    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        long_bundle = random_bundle(args.bundle, Path(tmp) / "long", n_ctx=max(contexts))
        steps = decode_step_ms(long_bundle, contexts, batch=32, steps=40, threads=args.threads)  # fp32 graph
        wide_bundle = random_bundle(args.bundle, Path(tmp) / "wide", vocab_size=args.sampler_vocab)
        sampler = sampler_share(wide_bundle, [1, 32], args.sampler_steps, args.threads)
    for ctx, ms in steps.items():
        print(f"batch 32, context {ctx:>4}: {ms:6.2f} ms/step, {32 / ms * 1e3:7.0f} tok/s")

    by_c = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["graph"] == graphs[0]}
    result = {"machine": machine, "matmul_gflops": ceiling, "flops_per_token": flops_per_token, "graphs": graphs,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "throughput": rows, "decode_step_ms_batch32": steps, "sampler_vocab": args.sampler_vocab,
              "sampler_share": sampler,
              "ratio_ctx512_vs_64": steps[64] / steps[512] if 64 in steps and 512 in steps else None,
              "ratio_c32_vs_c1": by_c[32] / by_c[1] if 1 in by_c and 32 in by_c else None}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        publish("engine", result, md, args.out)
    return 0


def render(r: dict, argv: list[str] | None) -> str:
    cmd = shown("attnserve bench engine" + (" " + " ".join(argv) if argv else ""))
    lines = ["## Engine, in-process", "", f"`{cmd}` on {machine_line(r['machine'])}.", "",
             f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} greedy new tokens each (ignore_eos), all "
             f"submitted at once; median of the runs. Matmul ceiling: fp32 1024×1024 in numpy, "
             f"{r['matmul_gflops']:.0f} GFLOP/s; {r['flops_per_token'] / 1e6:.1f} MFLOP per token "
             "(2 × the weights that take part in a matmul).", "",
             "| graph | concurrency | tokens/s | × concurrency 1 | of matmul ceiling |", "|---|---|---|---|---|"]
    for graph in r["graphs"]:
        mine = [row for row in r["throughput"] if row["graph"] == graph]
        base = mine[0]["tokens_per_s"]
        for row in mine:
            lines.append(f"| `{graph}` | {row['concurrency']} | {row['tokens_per_s']:.0f} | "
                         f"{row['tokens_per_s'] / base:.1f}× | {row['ceiling_fraction']:.0%} |")
    longest = max(int(ctx) for ctx in r["decode_step_ms_batch32"])
    lines += ["", f"Decode step at batch 32 against context length (same shape, fp32, random weights, {longest}-token "
                  "context):",
              "", "| context | ms/step | tokens/s | × context 64 |", "|---|---|---|---|"]
    s64 = r["decode_step_ms_batch32"].get(64)
    for ctx, ms in r["decode_step_ms_batch32"].items():
        rel = f"{s64 / ms:.2f}×" if s64 else "—"
        lines.append(f"| {ctx} | {ms:.2f} | {32 / ms * 1e3:.0f} | {rel} |")
    if r.get("sampler_share"):
        lines += ["", f"The sampler's share of a decode step at a {r['sampler_vocab']}-token vocabulary (same shape, "
                      "fp32, random weights; medians over the steps):", "",
                  "| workload | batch | step ms | sampling ms | share |", "|---|---|---|---|---|"]
        for row in r["sampler_share"]:
            lines.append(f"| {row['workload']} | {row['batch']} | {row['step_ms']:.2f} | {row['sample_ms']:.2f} | "
                         f"{row['share']:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
