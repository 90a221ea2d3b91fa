"""`attnserve bench <what>`: the benchmarks, one module each in bench/commands/ (see docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib
import sys

BENCHES = {  # name: (its module in bench/commands/, what it measures)
    "engine": ("engine", "the engine in-process: throughput, step time vs context, compute ceiling"),
    "serve": ("serve", "a load of concurrent streaming gRPC (or HTTP) clients: tokens/s, TTFT, ITL, errors"),
    "compare": ("compare", "HF transformers, optimum, attnserve in-process and over gRPC: one table; "
                           "--real-shapes: against llama.cpp at real shapes, long prompts, many streams"),
    "soak": ("soak", "a mixed load for minutes: server memory, throughput and errors over time"),
    "onnx-variants": ("onnx_variants", "every graph of a bundle: nodes, batch-1 latency, bits/char"),
    "quantization": ("quantization", "reduced-precision candidates against fp32 on this CPU: quality, speed"),
    "llama-shape": ("llama_shape", "a random Llama-family model of a real size (SmolLM2-135M's) through "
                                   "import-hf, export and the engine"),
    "rotary-placement": ("rotary_placement", "rotary positions inside GroupQueryAttention or as ops before it"),
    "prefix-cache": ("prefix_cache", "time to first token with a long cached prefix, against computing it whole"),
    "priority": ("priority", "interactive requests' time to first token alone and beside a batch job at a lower "
                             "and at the same priority; the batch's throughput"),
    "g2p": ("g2p", "the encoder-decoder G2P model against CTranslate2 and transformers: words/s alone "
                   "and 32 at a time"),
    "hostile": ("hostile", "hostile clients (idle connections, huge bodies, deep JSON, Tokenize at its limit) "
                           "against a default server: what they cost everyone else"),
    "bandwidth": ("bandwidth", "memory read bandwidth: the bound on a batch-1 decode step's weight reads"),
    "structured": ("structured", "structured output: llguidance's compile and mask times at 4k-150k vocabularies, "
                                 "random walks checked on both tokenizer kinds"),
    "replicas": ("replicas", "1, 2 and 3 replicas behind gRPC round robin and nginx: capacity, a rolling update, "
                             "a killed replica"),
    "speculative": ("speculative", "prompt-lookup speculative decoding at batch 1, and what a verification costs"),
    "startup": ("startup", "attnserve serve from launch to /health 200, first start and restart, by phase; what "
                           "warming decode up buys"),
    "kv-precision": ("kv_precision", "the KV cache in float32, float16 or int8: the attention op at a real shape "
                                     "(accepted, exact, speed) and the shipped model's quality"),
    "models": ("models", "several models in one server: a model's first request when it loads for it, a reload, the "
                         "memory an unload gives back; two engines decoding at once"),
    "memory": ("memory", "the KV cache's memory at a real shape: lazy pages against allocate-once, servers with no "
                         "memory flags under long prompts, llama.cpp's server, a 131k-position model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        width = max(map(len, BENCHES))
        print("usage: attnserve bench <what> [options]\n\nbenchmarks:")
        for name, (_, help_) in BENCHES.items():
            print(f"  {name:<{width}}  {help_}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return importlib.import_module(f"bench.commands.{BENCHES[argv[0]][0]}").main(argv[1:])
