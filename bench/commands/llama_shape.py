"""`attnserve bench llama-shape`: a Llama-family model of a real size, random weights, from a Hugging
Face checkpoint through `import-hf` and `export` to the engine, and its decode speed.

    attnserve bench llama-shape                       # SmolLM2-135M's shape
    attnserve bench llama-shape --layers 2 --hidden 64 --intermediate 96 --heads 4 --kv-heads 2 \\
        --vocab 512 --context 128 --concurrency 1,2 --new-tokens 4 --no-write       # seconds

The checkpoint is a `transformers.LlamaForCausalLM` with random weights, saved as transformers saves
it (no hub). It goes through the same commands a user runs (`attnserve import-hf`, `attnserve export
--int8`), then the engine decodes greedily: `c` requests of 16 random prompt tokens at once, 128 new
tokens each (ignore_eos), for each concurrency and each serving graph, median of --repeats. The
tokenizer is the shipped model's (the sampled ids are limited to its vocabulary; every step still
computes the full output layer). Peak memory is this process's maximum resident set.

Writes docs/bench/llama_shape.json (or into --out) and the llama_shape section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path

from attnserve.arguments import HintingParser
from bench.commands.engine import throughput
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from service.engine.config import DEFAULT_BUNDLE, EngineConfig
from service.engine.core import Engine
from service.runtime.bundle import BundleError

SMOLLM2_135M = dict(layers=30, heads=9, kv_heads=3, hidden=576, intermediate=1536, vocab=49152, context=2048)


def random_checkpoint(out: Path, tokenizer: Path, layers: int, heads: int, kv_heads: int, hidden: int,
                      intermediate: int, vocab: int, context: int) -> Path:
    """A random-weight LlamaForCausalLM of this shape, tied embeddings, saved by transformers."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=context, tie_word_embeddings=True, eos_token_id=0,
                                      bos_token_id=0, rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    return out


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench llama-shape", description=__doc__.split("\n\n")[0])
    for name, default in SMOLLM2_135M.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = one per core)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    shape = {name: getattr(args, name) for name in SMOLLM2_135M}
    levels = [int(c) for c in args.concurrency.split(",")]
    from export.bundle_writer import export_bundle
    from model.hf.import_hf import import_hf

    rows, timings, refused = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        random_checkpoint(root / "hf", DEFAULT_BUNDLE / "tokenizer.json", **shape)
        import_hf(root / "hf", root / "model")
        timings["import_s"] = time.perf_counter() - t
        t = time.perf_counter()
        graphs = [g for g in export_bundle(root / "model", root / "bundle", name="llama-shape", int8=True,
                                           keep_fp32=False) if g.startswith("static")]
        timings["export_s"] = time.perf_counter() - t
        for graph in graphs:
            config = EngineConfig(bundle=root / "bundle", graph=graph, max_running=max(levels), threads=args.threads,
                                  max_batch_tokens=max(512, max(levels) * (args.prompt_tokens + 1)))
            try:
                engine = Engine(config)
            except BundleError as e:  # the start-up self-check refused it on this CPU: say so, as serve would
                refused[graph] = str(e)
                print(f"{graph}: not served: {e}")
                continue
            kv_mib = engine.kv.n_slots * engine.kv.shape.bytes_per_slot / 2**20  # every slot full (address space)
            engine.warm_up()
            throughput(engine, 2, args.prompt_tokens, 4, seed=99)
            for c in levels:
                runs = [throughput(engine, c, args.prompt_tokens, args.new_tokens, seed=r) for r in range(args.repeats)]
                rows.append({"graph": graph, "concurrency": c, "tokens_per_s": statistics.median(runs), "runs": runs})
                print(f"{graph} concurrency {c:>3}: {rows[-1]['tokens_per_s']:7.1f} tok/s")
            del engine
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result = {"machine": describe(), "shape": shape, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "throughput": rows, "refused": refused, "kv_cache_mib": kv_mib,
              "peak_rss_gib": peak_gib,
              **timings}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        publish("llama_shape", result, md, args.out)
    return 0


def render(r: dict, argv: list[str] | None) -> str:
    s = r["shape"]
    cmd = shown("attnserve bench llama-shape" + (" " + " ".join(argv) if argv else ""))
    lines = ["## A Llama-family model of a real size", "", f"`{cmd}` on {machine_line(r['machine'])}.", "",
             f"A random-weight `LlamaForCausalLM`: {s['layers']} layers, {s['heads']} heads, {s['kv_heads']} KV heads, "
             f"hidden {s['hidden']}, intermediate {s['intermediate']}, vocabulary {s['vocab']}, tied, context "
             f"{s['context']} (SmolLM2-135M's shape by default), through `import-hf` ({r['import_s']:.0f} s with "
             f"the checkpoint's creation) and `export --int8` ({r['export_s']:.0f} s). "
             f"KV cache {r['kv_cache_mib']:.0f} MiB for {max(t['concurrency'] for t in r['throughput'])} slots; "
             f"peak memory of the whole run {r['peak_rss_gib']:.1f} GiB.", "",
             f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} greedy new tokens each (ignore_eos), all "
             "submitted at once, in-process; median of the runs.", "",
             "| graph | concurrency | tokens/s |", "|---|---|---|"]
    lines += [f"| `{t['graph']}` | {t['concurrency']} | {t['tokens_per_s']:.1f} |" for t in r["throughput"]]
    for graph, why in r.get("refused", {}).items():
        lines += ["", f"`{graph}` was not served: the start-up self-check refused it on this CPU. {why}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
