"""`attnserve bench models`: several models in one server: what a model's first request pays when the model
is loaded for it, what unloading gives back, and how two engines share the cores.

    attnserve bench models                                    # the shipped model and the shipped G2P model
    attnserve bench models --bundle A --bundle B --rounds 3   # e.g. a real-shape bundle beside the shipped one
    attnserve bench models --quick --no-write                 # seconds

- **load on demand**: one server holds every `--bundle`, the first loaded at start-up (`--preload default`),
  the others listed only. For each other model, in turn: its first request (a short prompt over gRPC, a few
  tokens) loads it, on a cache folder that has not seen it (the graph choice and self-check included: a
  "first load"); the next request finds it loaded; the model is unloaded (`UnloadModel`) and the server's
  resident memory read; a request loads it again (the choice now read from the cache folder: a "reload").
  Each request's time to first token as the client sees it; the load's own time from the server's log.
  Medians over the rounds (each round a new server and cache folder).
- **cores** (`--cores`, on the first two decoder bundles, or the `--cores-bundle`s, one bundle given once
  being served twice under two names): decode
  throughput of `--streams` streams of `--tokens` tokens on each model alone, then on both at once: the engines
  taking turns at the cores, a step at a time (the default), stepping at once with every core each
  (`--no-step-turns`), and stepping at once with one thread each (`--no-step-turns --threads 1`); beside them,
  the first model served alone by a server of its own (whose idle threads spin, as one model's do). The ways
  interleaved within each round; medians.

Writes docs/bench/models.json (or into --out) and the models section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from bench.memory_runs import vm_status
from service.client import AsyncClient
from service.client.server_process import ServerProcess
from service.engine.config import DEFAULT_BUNDLE
from service.runtime.bundle import read_manifest

SHIPPED_G2P = DEFAULT_BUNDLE.parent / "g2p-cmudict-onnx"
TOKEN = "bench-models"
PROMPT_TOKENS, NEW_TOKENS = 16, 8
LOADED = re.compile(r"model (\S+) loaded in ([0-9.]+) s")
DEFAULTS = dict(rounds=3, streams=4, tokens=64)
ALONE = "served alone (a server of one model)"
CORE_WAYS = {ALONE: [],
             "taking turns, every core each (default)": [],
             "at once, every core each": ["--no-step-turns"],
             "at once, one thread each": ["--no-step-turns", "--threads", "1"]}
QUICK = dict(rounds=1, streams=2, tokens=8)


async def first_token_s(client: AsyncClient, model: str, vocab: int, rng: np.random.Generator) -> float:
    started = time.perf_counter()
    ttft = None
    prompt = rng.integers(1, vocab, PROMPT_TOKENS).tolist()
    async for msg in client.stream_responses(prompt, model=model, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                             ignore_eos=True, timeout_s=1800):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - started
    assert ttft is not None, "the stream ended without a token"
    return ttft


async def load_round(server: ServerProcess, names: list[str], vocabs: dict[str, int], seed: int) -> dict:
    """Each model but the default: first request (loads it), second, unload, request again (reloads it)."""
    rng = np.random.default_rng(seed)
    out = {}
    async with AsyncClient(server.address, timeout_s=1800, token=TOKEN) as client:
        base = vm_status(server.pid).get("VmRSS", 0)
        for name in names[1:]:
            first = await first_token_s(client, name, vocabs[name], rng)
            loaded = await first_token_s(client, name, vocabs[name], rng)
            held = vm_status(server.pid).get("VmRSS", 0)
            await client.unload_model(name)
            after = vm_status(server.pid).get("VmRSS", 0)
            again = await first_token_s(client, name, vocabs[name], rng)
            loads = [float(s) for n, s in LOADED.findall(server.log()) if n == name]
            out[name] = {"first_request_s": first, "loaded_request_s": loaded, "reload_request_s": again,
                         "first_load_s": loads[0] if loads else None, "reload_s": loads[1] if len(loads) > 1 else None,
                         "rss_loaded": held, "rss_unloaded": after, "rss_start": base}
            await client.unload_model(name)  # the next model's figures without this one
    return out


async def decode_rate(client: AsyncClient, models: list[str], vocab: dict[str, int], streams: int, tokens: int,
                      rng: np.random.Generator) -> dict[str, float]:
    """Tokens/s of each of `models`, `streams` streams each, all at once."""
    async def one(model: str) -> tuple[int, float]:
        prompt = rng.integers(1, vocab[model], PROMPT_TOKENS).tolist()
        started = time.perf_counter()
        r = await client.generate(prompt, model=model, max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
        return r.usage.completion_tokens, time.perf_counter() - started

    started = time.perf_counter()
    results = await asyncio.gather(*(one(m) for m in models for _ in range(streams)))
    wall = time.perf_counter() - started
    rates = {}
    for i, model in enumerate(models):
        done = results[i * streams:(i + 1) * streams]
        rates[model] = sum(n for n, _ in done) / max(s for _, s in done)
    rates["total"] = sum(n for n, _ in results) / wall
    return rates


async def cores_round(server: ServerProcess, names: list[str], vocab: dict[str, int], args, seed: int) -> dict:
    """Each of `names` decoding alone, then (with two) both at once."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(server.address, timeout_s=1800) as client:
        await decode_rate(client, names, vocab, 1, 2, rng)  # loaded and warm
        alone = {name: (await decode_rate(client, [name], vocab, args.streams, args.tokens, rng))[name]
                 for name in names}
        together = await decode_rate(client, names, vocab, args.streams, args.tokens, rng) if len(names) > 1 else None
        return {"alone": alone, "together": together}


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench models", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, action="append", help="repeat; default: the shipped model and G2P model")
    p.add_argument("--cores", action="store_true", help="also measure two engines decoding at once")
    p.add_argument("--cores-bundle", type=Path, action="append",
                   help="the two decoders --cores runs (repeat; once: that bundle twice); default: the first two")
    for name, default in DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, help=f"default {default} ({QUICK[name]} with --quick)")
    p.add_argument("--max-context", type=int, help="served context of every model (a real shape's is long)")
    p.add_argument("--serve-args", default="", help="more `attnserve serve` flags, as one string")
    p.add_argument("--quick", action="store_true", help="a small run, in seconds, to check the command works")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    bundles = args.bundle or [DEFAULT_BUNDLE, SHIPPED_G2P]
    specs = [read_manifest(b).model for b in bundles]
    names = [f"m{i}-{spec.name}" for i, spec in enumerate(specs)]  # apart even when a bundle is given twice
    vocabs = dict(zip(names, (s.vocab_size for s in specs), strict=True))
    common = [*(["--max-context", str(args.max_context)] if args.max_context else []), *args.serve_args.split()]
    loads = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-models-") as cache:
            serve = [*(f for b in bundles for f in ("--bundle", str(b))),
                     *(f for n in names for f in ("--served-model-name", n)), "--preload", "default",
                     "--auth-token", TOKEN, "--cache-dir", cache, *common]
            with ServerProcess(serve, start_timeout_s=3600) as server:
                loads.append(asyncio.run(load_round(server, names, vocabs, seed=r)))
        said = [f"{n}: first {v['first_request_s']:.2f} s, reload {v['reload_request_s']:.2f} s"
                for n, v in loads[-1].items()]
        print(f"round {r + 1}: " + "; ".join(said), flush=True)
    cores = None
    if args.cores:
        if args.cores_bundle:
            decoders = [(b, f"c{i}-{read_manifest(b).model.name}") for i, b in enumerate(args.cores_bundle[:2])]
        else:
            decoders = [(b, n) for b, n, s in zip(bundles, names, specs, strict=True) if not s.encoder_decoder][:2]
        if len(decoders) == 1:
            decoders.append((decoders[0][0], decoders[0][1] + "-again"))
        pair = [n for _, n in decoders]
        cores = {"models": pair, "ways": {}}
        vocab = {n: read_manifest(b).model.vocab_size for b, n in decoders}
        for r in range(args.rounds):
            for way, flags in CORE_WAYS.items():
                served = decoders[:1] if way == ALONE else decoders
                serve = [*(f for b, _ in served for f in ("--bundle", str(b))),
                         *(f for _, n in served for f in ("--served-model-name", n)), *flags, *common]
                with ServerProcess(serve, start_timeout_s=3600) as server:
                    measured = asyncio.run(cores_round(server, [n for _, n in served], vocab, args, seed=r))
                cores["ways"].setdefault(way, []).append(measured)
                print(f"round {r + 1}, {way}: {cores['ways'][way][-1]}", flush=True)
    result = {"machine": describe(), "command": "attnserve bench models" + (" " + " ".join(argv) if argv else ""),
              "bundles": [str(b) for b in bundles], "names": names, "loads": loads, "cores": cores,
              "settings": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "streams": args.streams,
                           "tokens": args.tokens, "rounds": args.rounds}}
    md = render(result)
    print(md)
    if not args.no_write:
        publish("models", result, md, args.out)
    return 0


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["## Several models: loading on demand, unloading, sharing the cores", "",
             f"`{shown(r['command'])}` on {machine_line(r['machine'])}.", "",
             f"One server holds {', '.join(f'`{n}`' for n in r['names'])} (the first loaded at start-up). Per model, "
             f"over gRPC, {s['prompt_tokens']}-token prompts, {s['new_tokens']} tokens: the time to first token of "
             "its first request (which loads it, choosing and self-checking its graph on a cache folder that has not "
             "seen it), of the next (loaded), and of a request after `UnloadModel` (which loads it again, the choice "
             "read from the cache); the load itself from the server's log; the server's resident memory loaded and "
             f"after the unload. Medians of {s['rounds']} round(s), each a new server.", "",
             *(["Bundles under a `real-shapes` folder hold random weights at a real model's dimensions "
                "(`python -m bench.real_shapes build NAME`).", ""] if any("real-shapes" in b for b in r["bundles"])
               else []),
             "| model | first request (s) | of which the load (s) | loaded (s) | after an unload (s) | of which the "
             "reload (s) | RSS loaded → unloaded (MiB) |", "|---|---|---|---|---|---|---|"]
    for name in r["names"][1:]:
        rows = [round_[name] for round_ in r["loads"]]
        med = {k: _median([row[k] for row in rows]) for k in rows[0]}
        lines.append(f"| {name} | {_s(med['first_request_s'])} | {_s(med['first_load_s'])} | "
                     f"{med['loaded_request_s']:.3f} | {_s(med['reload_request_s'])} | "
                     f"{_s(med['reload_s'])} | {med['rss_loaded'] / 2**20:.0f} → {med['rss_unloaded'] / 2**20:.0f} |")
    if r["cores"]:
        c = r["cores"]
        a, b = c["models"]
        lines += ["", f"Two engines decoding at once ({s['streams']} streams of {s['tokens']} tokens on each), "
                  "tokens/s, medians:", "",
                  f"| engines' steps | {a} alone | {b} alone | {a} beside {b} | {b} beside {a} | both, in all |",
                  "|---|---|---|---|---|---|"]
        for way, rounds in c["ways"].items():
            def med(key: str, model: str, rounds=rounds) -> str:
                values = [x[key][model] for x in rounds if x[key] is not None and model in x[key]]
                return f"{statistics.median(values):.1f}" if values else "—"
            lines.append(f"| {way} | {med('alone', a)} | {med('alone', b)} | {med('together', a)} | "
                         f"{med('together', b)} | {med('together', 'total')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
