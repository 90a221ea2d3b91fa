"""`attnserve bench prefix-cache`: time to first token of a prompt whose long prefix is cached, against
the same prompt computed whole, over gRPC.

    attnserve bench prefix-cache                                  # GPT-2 124M's shape, 1000 + 20 tokens
    attnserve bench prefix-cache --layers 2 --hidden 64 --heads 4 --vocab 4096 --context 256 \\
        --prefix-tokens 200 --rounds 2 --no-write                 # seconds

A random-weight model of GPT-2 124M's shape (the static fp32 graph) is served by `attnserve serve` in a
child process. Each round draws a new random prefix of --prefix-tokens ids and sends, one after the
other, three streaming requests of that prefix plus a different --suffix-tokens suffix:
1. cold: the prefix is new, so the whole prompt is computed (and its blocks kept);
2. warm: the prefix's blocks are in the cache; only the suffix is computed;
3. off: the same prompt to a second server started with --no-prefix-caching, for reference.
Rounds interleave the three, so a noisy machine slows them alike; the table gives medians, and the
server's usage reports how many prompt tokens came from the cache. Writes docs/bench/prefix_cache.json
(or into --out) and the prefix_cache section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from service.client import Client
from service.client.server_process import ServerProcess
from service.engine.config import DEFAULT_BUNDLE

GPT2_124M = dict(layers=12, heads=12, hidden=768, vocab=50257, context=1024)
TARGET = 5.0  # warm TTFT at most 1/5 of cold


def first_token(client: Client, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens the server took from its prefix cache)."""
    started = time.perf_counter()
    ttft, cached = None, 0
    for msg in client.stream_responses(prompt, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - started
        if msg.HasField("usage"):
            cached = msg.usage.cached_prompt_tokens
    assert ttft is not None, "the stream ended without a token"
    return ttft, cached


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench prefix-cache", description=__doc__.split("\n\n")[0])
    for name, default in GPT2_124M.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--suffix-tokens", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    if args.prefix_tokens + args.suffix_tokens + args.new_tokens > args.context:
        p.error("prefix + suffix + new tokens must fit the context")
    from bench.commands.engine import random_bundle  # needs torch: the model is built here

    rng = np.random.default_rng(args.seed)
    times: dict[str, list[float]] = {"cold": [], "warm": [], "off": []}
    cached: dict[str, list[int]] = {k: [] for k in times}
    with tempfile.TemporaryDirectory(prefix="attnserve-prefix-") as tmp:
        bundle = random_bundle(DEFAULT_BUNDLE, Path(tmp) / "bundle", n_layer=args.layers, n_head=args.heads,
                               d_model=args.hidden, vocab_size=args.vocab, n_ctx=args.context)
        common = ["--bundle", str(bundle), "--graph", "static", "--max-running", "4", "--no-warmup"]
        with ServerProcess(common) as on, ServerProcess([*common, "--no-prefix-caching"]) as off, \
                Client(on.address, timeout_s=600) as c_on, Client(off.address, timeout_s=600) as c_off:
            first_token(c_on, rng.integers(1, args.vocab, 64).tolist(), 1)  # first runs allocate: untimed
            first_token(c_off, rng.integers(1, args.vocab, 64).tolist(), 1)
            for r in range(args.rounds):
                prefix = rng.integers(1, args.vocab, args.prefix_tokens).tolist()
                suffixes = [rng.integers(1, args.vocab, args.suffix_tokens).tolist() for _ in range(2)]
                for kind, client, suffix in (("cold", c_on, suffixes[0]), ("warm", c_on, suffixes[1]),
                                             ("off", c_off, suffixes[1])):
                    ttft, hit = first_token(client, prefix + suffix, args.new_tokens)
                    times[kind].append(ttft)
                    cached[kind].append(hit)
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in
                                                                    times.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["cold"] / medians["warm"]
    result = {"machine": describe(), "command": "attnserve bench prefix-cache" + (" " + " ".join(argv) if argv else ""),
              "shape": {k: getattr(args, k) for k in GPT2_124M}, "prefix_tokens": args.prefix_tokens,
              "suffix_tokens": args.suffix_tokens, "rounds": args.rounds, "ttft_s": times, "cached_tokens": cached,
              "median_ttft_s": medians, "cold_over_warm": ratio, "target": TARGET, "met": bool(ratio >= TARGET)}
    md = render(result)
    print(md)
    if not args.no_write:
        publish("prefix_cache", result, md, args.out)
    return 0


def render(r: dict) -> str:
    s, m = r["shape"], r["median_ttft_s"]
    shape = f"{s['layers']} layers, {s['hidden']} wide, {s['heads']} heads, vocab {s['vocab']}, context {s['context']}"
    cached = statistics.median(r["cached_tokens"]["warm"])
    lines = ["## Prefix caching: time to first token with a cached prefix", "",
             f"`{shown(r['command'])}` on {machine_line(r['machine'])}.", "",
             f"Random weights of {shape} (fp32 serving graph) over gRPC. Each of {r['rounds']} rounds sends a new "
             f"{r['prefix_tokens']}-token prefix with a {r['suffix_tokens']}-token suffix (cold: computed whole), "
             f"then the same prefix with another suffix (warm: the server reported {cached:.0f} prompt tokens from "
             "its cache), and the warm prompt to a server run with --no-prefix-caching. Medians:", "",
             "| request | TTFT (ms) |", "|---|---|",
             f"| cold (prefix new) | {m['cold'] * 1e3:.1f} |",
             f"| warm (prefix cached) | {m['warm'] * 1e3:.1f} |",
             f"| prefix caching off | {m['off'] * 1e3:.1f} |", "",
             f"Warm TTFT is 1/{r['cold_over_warm']:.1f} of cold: the target (at most 1/{r['target']:.0f}) is "
             + ("met." if r["met"] else "**missed**.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
