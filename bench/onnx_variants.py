"""Measure every graph of a bundle: node count, batch-1 decode latency, held-out bits/char.

    python -m bench.onnx_variants --bundle models/shakespeare/onnx [--threads 2] [--quality]

Latency: a 16-token prompt, then 64 greedy decode steps at batch 1; the median step time over
`--repeats` runs. Quality (--quality): bits/char on the held-out plays through onnxruntime, scored
exactly as training scores PyTorch (`model.scoring`). Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from model.data import load_corpus
from model.scoring import bits_per_char, encode_documents, eval_batches
from service.bundle import read_manifest
from service.concat_runner import OnnxRunner


def decode_latency_ms(runner: OnnxRunner, prompt_len: int = 16, steps: int = 64, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    medians = []
    for _ in range(repeats):
        ids = rng.integers(0, runner.manifest.model.vocab_size, (1, prompt_len))
        logits, cache = runner.step(ids, np.arange(prompt_len)[None], np.ones_like(ids), runner.empty_cache(1))
        times = []
        for t in range(prompt_len, prompt_len + steps):
            nxt = np.argmax(logits[:, -1], axis=-1)[:, None]
            start = time.perf_counter()
            logits, cache = runner.step(nxt, np.array([[t]]), np.ones((1, t + 1), dtype=np.int64), cache)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return 1000 * statistics.median(medians)


def held_out_bits_per_char(runner: OnnxRunner) -> float:
    corpus = load_corpus()
    data = encode_documents(runner.tokenizer, corpus.val)
    nll, count = 0.0, 0
    for x, y in eval_batches(data, runner.manifest.model.n_ctx):
        mask = np.ones_like(x)
        pos = np.broadcast_to(np.arange(x.shape[1]), x.shape)
        logits, _ = runner.step(x, pos, mask, runner.empty_cache(x.shape[0]))
        logits = logits.astype(np.float64)
        m = logits.max(-1, keepdims=True)
        logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
        nll += float((logz - np.take_along_axis(logits, y[..., None], -1)[..., 0]).sum())
        count += y.size
    return bits_per_char(nll / count, count, corpus.val_chars)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=Path("models/shakespeare/onnx"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality", action="store_true", help="also score the held-out plays (slow)")
    p.add_argument("--json", type=Path, default=Path("docs/bench/onnx_variants.json"))
    args = p.parse_args(argv)

    import onnx

    manifest = read_manifest(args.bundle)
    rows = []
    for name, spec in manifest.graphs.items():
        runner = OnnxRunner(args.bundle, graph=name, provider="cpu", intra_op_threads=args.threads)
        row = {"graph": name, "file": spec.file, "nodes": len(onnx.load(str(args.bundle / spec.file)).graph.node),
               "size_mb": round((args.bundle / spec.file).stat().st_size / 1e6, 2),
               "decode_ms_b1": round(decode_latency_ms(runner, repeats=args.repeats), 3)}
        if args.quality:
            row["val_bits_per_char"] = round(held_out_bits_per_char(runner), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, onnxruntime {ort.__version__}",
              "threads": args.threads, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    cols = [c for c in ("graph", "nodes", "size_mb", "decode_ms_b1", "val_bits_per_char") if c in rows[0]]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
