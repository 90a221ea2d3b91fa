"""`attnserve bench onnx-variants`: every graph of a bundle: node count, batch-1 decode latency, bits/char.

    attnserve bench onnx-variants [--bundle models/shakespeare-onnx] [--threads 2] [--quality] [--no-write]
    attnserve bench onnx-variants --bundle ... --repeats 1 --no-write      # seconds, without --quality

Each graph runs through the runner of its cache layout: static-cache graphs through the serving
runner (`service.runtime.static_runner.StaticRunner`, on a KV cache of its own), concat-cache graphs through the
reference runner (`service.runtime.concat_runner.ConcatRunner`). Latency: a 16-token prompt, then 64 greedy
decode steps at batch 1 (fewer if the context is shorter); the median step time over --repeats runs.
Quality (--quality): bits/char on the held-out plays through onnxruntime, scored exactly as training
scores PyTorch (`model.training.scoring`), each window in one forward pass that returns every position's logits.
Prints a markdown table; writes docs/bench/onnx_variants.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from model.training.data import load_corpus
from model.training.scoring import bits_per_char, encode_documents, eval_batches, nll_sum
from service.engine.config import DEFAULT_BUNDLE
from service.runtime.bundle import GraphSpec, read_manifest
from service.runtime.concat_runner import ConcatRunner
from service.runtime.self_check import logits_at_every_position
from service.runtime.static_runner import StaticRunner
from service.runtime.tokenizer import Tokenizer

PROMPT_TOKENS = 16
DECODE_STEPS = 64


class StaticGraph:
    """A static-cache graph through the serving runner."""

    def __init__(self, bundle: Path, name: str, threads: int):
        self.runner = StaticRunner(bundle, name, provider="cpu", intra_op_threads=threads)
        self.tokenizer, self.model = self.runner.tokenizer, self.runner.manifest.model

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """A fresh one-slot cache holding `prompt`; the last position's logits [vocab]."""
        self.runner.attach(self.runner.cache_shape.buffers(1))
        return self.runner.prefill_batch(0, [prompt])[0]

    def decode(self, token: int, position: int) -> np.ndarray:
        return self.runner.decode(np.array([token]), np.array([position]))[0]

    def window_logits(self, windows: np.ndarray) -> np.ndarray:
        return logits_at_every_position(self.runner, windows)


class ConcatGraph:
    """A concat-cache graph through the reference runner."""

    def __init__(self, bundle: Path, name: str, threads: int):
        self.runner = ConcatRunner(bundle, graph=name, provider="cpu", intra_op_threads=threads)
        self.tokenizer, self.model = self.runner.tokenizer, self.runner.manifest.model
        self.cache: list[np.ndarray] = []

    def prefill(self, prompt: list[int]) -> np.ndarray:
        ids = np.array([prompt])
        logits, self.cache = self.runner.step(ids, np.arange(len(prompt))[None], np.ones_like(ids),
                                              self.runner.empty_cache(1))
        return logits[0, -1]

    def decode(self, token: int, position: int) -> np.ndarray:
        logits, self.cache = self.runner.step(np.array([[token]]), np.array([[position]]),
                                              np.ones((1, position + 1), dtype=np.int64), self.cache)
        return logits[0, -1]

    def window_logits(self, windows: np.ndarray) -> np.ndarray:
        pos = np.broadcast_to(np.arange(windows.shape[1]), windows.shape)
        return self.runner.step(windows, pos, np.ones_like(windows), self.runner.empty_cache(len(windows)))[0]


def open_graph(bundle: Path, name: str, spec: GraphSpec, threads: int) -> StaticGraph | ConcatGraph:
    return (StaticGraph if spec.cache == "static" else ConcatGraph)(bundle, name, threads)


def decode_latency_ms(graph: StaticGraph | ConcatGraph, steps: int, repeats: int) -> float:
    """Median over `repeats` runs of the median batch-1 decode step after a PROMPT_TOKENS prompt."""
    rng = np.random.default_rng(0)
    medians = []
    for _ in range(repeats):
        logits = graph.prefill(rng.integers(0, graph.model.vocab_size, PROMPT_TOKENS).tolist())
        times = []
        for position in range(PROMPT_TOKENS, PROMPT_TOKENS + steps):
            token = int(np.argmax(logits))
            start = time.perf_counter()
            logits = graph.decode(token, position)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return 1000 * statistics.median(medians)


def held_out_ids(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """The held-out plays as one id stream, and their characters."""
    corpus = load_corpus()
    return encode_documents(tokenizer, corpus.val), corpus.val_chars


def held_out_bits_per_char(window_logits: Callable[[np.ndarray], np.ndarray], held_out: tuple[np.ndarray, int],
                           n_ctx: int, max_windows: int | None = None) -> float:
    """Bits/char of the held-out ids (`held_out_ids`), given the logits at every position of a batch
    of windows. With `max_windows`, an even spread of that many windows stands for the whole text."""
    data, chars = held_out
    nll, count = 0.0, 0
    for x, y in eval_batches(data, n_ctx, max_windows):
        nll += nll_sum(window_logits(x), y)
        count += y.size
    return bits_per_char(nll / count, count, round(chars * count / (len(data) - 1)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv  # `python -m bench.commands.onnx_variants` (make bench-onnx) too
    p = HintingParser(prog="attnserve bench onnx-variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality", action="store_true", help="also score the held-out plays (slow)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)

    import onnx

    from export.external_data import data_path

    manifest = read_manifest(args.bundle)
    steps = min(DECODE_STEPS, manifest.model.n_ctx - PROMPT_TOKENS)
    rows = []
    for name, spec in manifest.graphs.items():
        graph = open_graph(args.bundle, name, spec, args.threads)
        path = args.bundle / spec.file
        row = {"graph": name, "file": spec.file, "cache": spec.cache, "weights": spec.weights,
               "nodes": len(onnx.load(str(path), load_external_data=False).graph.node),
               "size_mb": round(sum(f.stat().st_size for f in (path, data_path(path)) if f.is_file()) / 1e6, 2),
               "decode_ms_b1": round(decode_latency_ms(graph, steps, args.repeats), 3)}
        if args.quality:
            bpc = held_out_bits_per_char(graph.window_logits, held_out_ids(graph.tokenizer), manifest.model.n_ctx)
            row["val_bits_per_char"] = round(bpc, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = {"machine": describe(), "bundle": args.bundle.name, "threads": args.threads, "repeats": args.repeats,
              "prompt_tokens": PROMPT_TOKENS, "decode_steps": steps, "rows": rows}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        publish("onnx_variants", result, md, args.out)
    return 0


def render(r: dict, argv: list[str] | None) -> str:
    cmd = shown("attnserve bench onnx-variants" + (" " + " ".join(argv) if argv else ""))
    cols = [c for c in ("graph", "cache", "weights", "nodes", "size_mb", "decode_ms_b1", "val_bits_per_char")
            if c in r["rows"][0]]
    lines = ["## ONNX graph variants", "",
             f"`{cmd}` on {machine_line(r['machine'])}; bundle `{r['bundle']}`, {r['threads']} intra-op threads.", "",
             f"Batch-1 decode: a {r['prompt_tokens']}-token prompt, then {r['decode_steps']} greedy steps; the "
             f"median step time, median of {r['repeats']} runs. Static-cache graphs run through the serving "
             "runner, concat-cache graphs through the reference runner.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in r["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
