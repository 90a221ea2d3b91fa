"""The benchmark commands: one module per `attnserve bench <name>` (registered in `bench.cli.BENCHES`), each
with `main(argv)`, each writing docs/bench/<name>.json and its section of docs/BENCHMARKS.md.

- bandwidth.py         `bench bandwidth`: this machine's memory read bandwidth, the bound on a batch-1 decode step
- compare.py           `bench compare`: attnserve against the CPU engines in bench/peers/, at three sizes, one run
- compare_real.py      `bench compare --real-shapes`: attnserve against llama.cpp at real shapes, long prompts
- engine.py            `bench engine`: the engine in-process: throughput, step time against context, compute ceiling
- g2p.py               `bench g2p`: the encoder-decoder G2P model against CTranslate2 and transformers
- hostile.py           `bench hostile`: what hostile clients cost everyone else
- kv_precision.py      `bench kv-precision`: the KV cache in float32, float16 or int8: op speed, model quality
- memory.py            `bench memory`: the KV cache's memory at a real shape, servers under long prompts, llama.cpp
- llama_shape.py       `bench llama-shape`: a random Llama-family model of a real size through import-hf and export
- onnx_variants.py     `bench onnx-variants`: every graph of a bundle: nodes, batch-1 latency, bits/char
- prefix_cache.py      `bench prefix-cache`: time to first token with a long cached prefix, against computing it
- quantization.py      `bench quantization`: reduced-precision candidates against fp32 on this CPU
- rotary_placement.py  `bench rotary-placement`: rotary positions inside GroupQueryAttention or as ops before it
- serve.py             `bench serve`: concurrent streaming gRPC (or HTTP) clients: tokens/s, TTFT, ITL, errors
- soak.py              `bench soak`: a mixed load for minutes: server memory, throughput and errors over time
- structured.py        `bench structured`: llguidance's compile and mask times; constrained walks, checked
"""
