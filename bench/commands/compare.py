"""`attnserve bench compare`: attnserve against the CPU engines a user would otherwise pick, at three sizes, in one run.

    attnserve bench compare                       # every size, every system, 3 interleaved rounds (make bench)
    attnserve bench compare --sizes gpt2-124m --systems attnserve,attnserve-grpc,llama.cpp --repeats 1
    attnserve bench compare --quick --no-write    # tiny random sizes, 8 tokens: a smoke test in a minute
    attnserve bench compare --real-shapes         # against llama.cpp at real shapes (bench/commands/compare_real.py)

For each size of `bench.sizes` (the shipped model; GPT-2 124M's shape; SmolLM2-135M's shape) it prepares
the weights once as every system takes them: attnserve's bundle (graphs static, static-int8,
static-int8-per-tensor, static-int4) and, through `attnserve export-hf`, one Hugging Face directory that
every peer converts with its own tool (`bench.peers.systems`). Every system gets the same prompt ids
(random, --seed), exactly --new-tokens greedy tokens per sequence (end-of-text masked until then), and
runs in a process of its own by the peer protocol (`bench.peers.protocol`): batch 1 (--singles prompts
one after another; tokens/s with prefill, TTFT) and 32 concurrent streams (aggregate tokens/s, TTFT
p50/p99), its peak RSS, and the greedy ids of both. The batch-1 prompts are the first --singles of the
32 stream prompts, so every system also shows whether its output depends on the batch: how many of
them got the same ids alone as among the 32 (`alone_equals_batched`). A round runs every system once;
the rounds repeat --repeats times per size, in an order rotated by one system each round, so that a
slow drift of the machine falls on every system alike. The table shows medians over rounds and, for
each system, greedy agreement with fp32 transformers (rows of the 32 identical to its, and the mean
length of the common prefix).

The targets it checks, per size and precision class, are listed in docs/BENCHMARKS.md#targets.

A missing peer is skipped with one line. It writes docs/bench/compare.json, docs/bench/compare.png (or
both into --out) and the compare section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from attnserve.arguments import HintingParser
from bench import workload
from bench.machine import RESULTS_DIR, ROOT, describe, machine_line, publish, shown
from bench.peers.systems import GRAPHS, REFERENCE, Model, System, convert, measure, select, unavailable

STREAMS = 32
CLASSES = {"fp32": ("fp32", "f32"), "8-bit": ("int8", "int8-per-tensor", "q8_0"),  # class -> precisions
           "4-bit": ("int4", "q4_0")}
OURS = {"fp32": "fp32", "8-bit": "int8", "4-bit": "int4"}  # class -> attnserve's precision in it
STREAMS_LEAST = 1.5  # 32 gRPC streams against the best peer's aggregate tokens/s
SINGLE_LEAST = 1.1  # batch 1 over gRPC against the best peer's
BOUND_LEAST = 0.8  # batch 1 in-process against the memory-bandwidth bound
BOUND_SIZE = "gpt2-124m"  # where the bound is a target (shown at every size)
QUICK_SHAPES = {  # --quick: the random sizes at shapes that build in seconds (GPT-2's MLP is 4 × d_model)
    "gpt2-124m": dict(vocab_size=1024, n_ctx=128, n_layer=3, n_head=4, d_model=64),
    "smollm2-135m": dict(vocab_size=1024, n_ctx=128, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=96),
}


def make_spec(vocab: int, prompt_tokens: int, new_tokens: int, singles: int, seed: int) -> dict:
    """The run spec every system gets: 32 stream prompts and, for batch 1, the first `singles` of them (so
    that each of those runs both alone and among the 32), one round each."""
    if not 1 <= singles <= STREAMS:
        raise ValueError(f"{singles} batch-1 prompts: they are the first of the {STREAMS} streams (1 to {STREAMS})")
    prompts = [item.prompt for item in workload.fixed(STREAMS, prompt_tokens, new_tokens, vocab, seed)]
    return {"new_tokens": new_tokens, "single": prompts[:singles], "streams": prompts, "repeats": 1}


def rotated(systems: list, round_index: int) -> list:
    k = round_index % len(systems) if systems else 0
    return systems[k:] + systems[:k]


# ---- from the rounds' results to one row per system -----------------------------------------------


def agreement(tokens: list[list[int]] | None, reference: list[list[int]] | None) -> dict:
    """Rows identical to the reference's, and the mean length of each row's prefix in common with it."""
    if tokens is None or reference is None:
        return {"exact_rows": None, "rows": None, "mean_prefix": None}
    prefixes = []
    for row, ref in zip(tokens, reference, strict=True):
        n = 0
        while n < min(len(row), len(ref)) and row[n] == ref[n]:
            n += 1
        prefixes.append(n)
    exact = sum(1 for row, ref in zip(tokens, reference, strict=True) if row == ref)
    return {"exact_rows": exact, "rows": len(reference), "mean_prefix": statistics.mean(prefixes)}


def alone_equals_batched(single_tokens: list[list[int]] | None, tokens: list[list[int]] | None) -> int | None:
    """How many batch-1 prompts got exactly the ids alone that they got among the streams (the batch-1
    prompts are the first streams: `make_spec`); None for a system without ids."""
    if single_tokens is None or tokens is None:
        return None
    return sum(1 for alone, batched in zip(single_tokens, tokens[:len(single_tokens)], strict=True)
               if alone == batched)


def _median(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def summarize_system(system: System, size: str, results: list[dict], reference: list[list[int]] | None) -> dict:
    """One table row from a system's rounds: medians over rounds (each round's own median over its repeats)."""
    def over(phase: str, field: str) -> float | None:
        per_round = [r[phase][field] for r in results if r[phase].get(field) is not None]
        return _median(_median(v) if isinstance(v, list) else v for v in per_round)

    tokens, single_tokens = results[0]["tokens"], results[0].get("single_tokens")
    stable = all(r["tokens"] == tokens for r in results)
    return {"size": size, "key": system.key, "system": system.label, "family": system.family,
            "precision": system.precision, "ours": system.ours, "rounds": len(results),
            "single_tokens_per_s": over("single", "tokens_per_s"), "single_ttft_s": over("single", "ttft_s"),
            "streams_tokens_per_s": over("streams", "tokens_per_s"), "ttft_p50_s": over("streams", "ttft_p50_s"),
            "ttft_p99_s": over("streams", "ttft_p99_s"),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            **agreement(tokens, reference), "tokens_same_every_round": stable if tokens is not None else None,
            "alone_equals_batched": alone_equals_batched(single_tokens, tokens),
            "alone_prompts": len(single_tokens) if single_tokens is not None else None,
            "settings": results[0].get("settings", {}), "versions": results[0].get("versions", {}),
            "runs": [{k: r[k] for k in ("single", "streams", "peak_rss_bytes")} for r in results]}


# ---- targets --------------------------------------------------------------------------------------


def row_of(rows: list[dict], size: str, family: str, precision: str) -> dict | None:
    return next((r for r in rows if r["size"] == size and r["family"] == family and r["precision"] == precision),
                None)


def class_peers(rows: list[dict], size: str, klass: str) -> list[dict]:
    return [r for r in rows if r["size"] == size and not r["ours"] and r["precision"] in CLASSES[klass]]


def _best(rows: list[dict], field: str) -> dict | None:
    measured = [r for r in rows if r.get(field) is not None]
    return max(measured, key=lambda r: r[field]) if measured else None


def _ratio_target(size: str, klass: str, text: str, ours: dict | None, peers: list[dict], field: str,
                  least: float) -> dict:
    best = _best(peers, field)
    value = ours.get(field) if ours else None
    ratio = value / best[field] if value is not None and best is not None else math.nan
    return {"size": size, "class": klass, "target": text, "least": least, "ratio": ratio,
            "ours": value, "peer": f"{best['system']} {best['precision']}" if best else None,
            "peer_value": best[field] if best else None, "met": None if math.isnan(ratio) else bool(ratio >= least)}


def _agreement_target(size: str, klass: str, ours: dict | None, peers: list[dict]) -> dict:
    """Against the class's fastest peer at 32 streams among those that return token ids."""
    peer = _best([p for p in peers if p["exact_rows"] is not None], "streams_tokens_per_s")
    text = "greedy agreement with fp32 transformers ≥ the fastest peer's"
    out = {"size": size, "class": klass, "target": text, "least": None, "ratio": math.nan, "met": None,
           "ours": None, "peer": None, "peer_value": None}
    if ours is None or ours["exact_rows"] is None or peer is None:
        return out
    met = ours["exact_rows"] >= peer["exact_rows"] and ours["mean_prefix"] >= peer["mean_prefix"] - 1e-9
    return {**out, "ours": (ours["exact_rows"], ours["mean_prefix"]), "peer": f"{peer['system']} {peer['precision']}",
            "peer_value": (peer["exact_rows"], peer["mean_prefix"]), "met": bool(met)}


def evaluate(rows: list[dict]) -> list[dict]:
    """Every target, per size and precision class, met / missed (None: a side of it was not measured)."""
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        for klass in CLASSES:
            grpc = row_of(rows, size, "attnserve-grpc", OURS[klass])
            peers = class_peers(rows, size, klass)
            if grpc is None and not peers:
                continue
            out.append(_ratio_target(size, klass, f"32 gRPC streams ≥ {STREAMS_LEAST}× the best peer", grpc, peers,
                                     "streams_tokens_per_s", STREAMS_LEAST))
            out.append(_ratio_target(size, klass, f"batch 1 over gRPC ≥ {SINGLE_LEAST}× the best peer", grpc, peers,
                                     "single_tokens_per_s", SINGLE_LEAST))
            out.append(_agreement_target(size, klass, grpc, peers))
            inproc = row_of(rows, size, "attnserve", OURS[klass])
            if size == BOUND_SIZE and inproc is not None and inproc.get("bound_tokens_per_s"):
                ratio = inproc["single_tokens_per_s"] / inproc["bound_tokens_per_s"]
                out.append({"size": size, "class": klass, "target": f"batch 1 ≥ {BOUND_LEAST:.0%} of the "
                            "memory-bandwidth bound", "least": BOUND_LEAST, "ratio": ratio,
                            "ours": inproc["single_tokens_per_s"], "peer": "bound",
                            "peer_value": inproc["bound_tokens_per_s"], "met": bool(ratio >= BOUND_LEAST)})
    return out


def add_bounds(rows: list[dict], bundles: dict[str, Path], gb_per_s: float | None) -> None:
    """Each attnserve row's batch-1 bound (tokens/s) from its graph's weight bytes and the read bandwidth."""
    if not gb_per_s:
        return
    from bench.roofline import bound_tokens_per_s, graph_weight_bytes_per_token

    for r in rows:
        if r["ours"]:
            weight_bytes = graph_weight_bytes_per_token(bundles[r["size"]], GRAPHS[r["precision"]])
            r["weight_bytes_per_token"] = weight_bytes
            r["bound_tokens_per_s"] = bound_tokens_per_s(weight_bytes, gb_per_s)


# ---- the run ----------------------------------------------------------------------------------------


def run_size(size: str, args, systems: list[System], notes: list[str], log=print) -> tuple[list[dict], dict]:
    """Prepare one size, convert for every system, run the interleaved rounds: (rows, what was run on)."""
    from bench.sizes import prepare

    started = time.perf_counter()
    p = prepare(size, args.work, shape=QUICK_SHAPES.get(size) if args.quick else None)
    from service.runtime.bundle import read_manifest

    model = Model(p.hf_dir, p.bundle, tuple(read_manifest(p.bundle).graphs), args.work / size / "peers")
    model.work.mkdir(parents=True, exist_ok=True)
    new_tokens = min(args.new_tokens, p.n_ctx - args.prompt_tokens)
    spec = make_spec(p.vocab_size, args.prompt_tokens, new_tokens, args.singles, args.seed)
    spec_path = model.work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log(f"{size}: {p.arch}, {p.parameters / 1e6:.1f} M parameters, vocabulary {p.vocab_size}; "
        f"prepared in {time.perf_counter() - started:.0f} s")
    active = []
    for s in systems:
        why = unavailable(s, model)
        if why is None:
            log(f"  {s.key}: its model")
            try:
                convert(s, model)
            except Exception as e:  # a converter that fails is a peer that cannot run here
                why = f"conversion failed: {(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}"
        if why is None:
            active.append(s)
        else:
            notes.append(f"{size}: {s.key} skipped: {why}")
            log(f"  {s.key} skipped: {why}")
    results: dict[str, list[dict]] = {s.key: [] for s in active}
    seconds: dict[str, list[float]] = {s.key: [] for s in active}
    for rnd in range(args.repeats):
        log(f"  round {rnd + 1}/{args.repeats}")
        for s in rotated([s for s in active if s.key in results], rnd):
            t0 = time.perf_counter()
            try:
                r = measure(s, model, spec, spec_path)
            except Exception as e:
                why = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
                notes.append(f"{size}: {s.key} failed in round {rnd + 1} and was dropped: {why}")
                log(f"  {s.key} failed: {e}")
                results.pop(s.key)
                continue
            seconds[s.key].append(time.perf_counter() - t0)
            results[s.key].append(r)
            log(f"    {s.key:30s} batch 1 {r['single']['tokens_per_s'][0]:8.1f} tok/s   "
                f"{r['streams']['n']} streams {r['streams']['tokens_per_s'][0]:8.1f} tok/s   "
                f"({seconds[s.key][-1]:.0f} s)")
    reference = results.get(REFERENCE, [{}])[0].get("tokens")
    by_key = {s.key: s for s in active}
    rows = [summarize_system(by_key[k], size, rs, reference) for k, rs in results.items() if rs]
    for row in rows:
        row["seconds_per_round"] = _median(seconds[row["key"]])
    info = {"size": size, "arch": p.arch, "parameters": p.parameters, "vocab_size": p.vocab_size, "n_ctx": p.n_ctx,
            "bundle": str(p.bundle), "graphs": list(model.graphs), "new_tokens": new_tokens,
            "prompt_tokens": args.prompt_tokens, "singles": args.singles, "streams": STREAMS,
            "seconds": time.perf_counter() - started}
    return rows, info


def main(argv: list[str] | None = None) -> int:
    from bench.sizes import SIZES

    argv = sys.argv[1:] if argv is None else argv
    if "--real-shapes" in argv:
        from bench.commands import compare_real

        return compare_real.main([a for a in argv if a != "--real-shapes"])
    p = HintingParser(prog="attnserve bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--real-shapes", action="store_true",
                   help="attnserve against llama.cpp at real shapes, long prompts and many streams instead "
                        "(bench/commands/compare_real.py; its own flags: --real-shapes --help)")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--systems", default="", help="only these (keys like ctranslate2:int8, or families; "
                                                 "default: all)")
    p.add_argument("--skip", default="", help="leave these out (keys or families)")
    p.add_argument("--repeats", type=int, default=2,
                   help="interleaved rounds over every system, per size (two over the three sizes: an hour on 2 cores)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--singles", type=int, default=3,
                   help="batch-1 prompts (the first of the 32 stream prompts), run one after another")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "compare",
                   help="prepared sizes and converted models, kept between runs")
    p.add_argument("--bandwidth-gbps", type=float, help="read bandwidth for the bound (default: measured now)")
    p.add_argument("--quick", action="store_true",
                   help="tiny random sizes, 8-token prompts, 8 new tokens, 1 batch-1 prompt, 1 round")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and the plot go")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.prompt_tokens, args.singles, args.repeats = 8, 8, 1, 1
    sizes = [s for s in args.sizes.split(",") if s]
    systems = select(args.systems, args.skip)
    if args.quick and args.work == p.get_default("work"):
        args.work = Path(tempfile.mkdtemp(prefix="attnserve-compare-"))
    notes: list[str] = []
    rows, infos = [], []
    for size in sizes:
        size_rows, info = run_size(size, args, systems, notes)
        rows += size_rows
        infos.append(info)
    gb_per_s = args.bandwidth_gbps
    if gb_per_s is None and any(r["ours"] for r in rows):
        from bench.commands.bandwidth import read_bandwidth

        gb_per_s = read_bandwidth(*((64, 1) if args.quick else ()))
    add_bounds(rows, {i["size"]: Path(i["bundle"]) for i in infos}, gb_per_s)
    result = {"machine": describe(), "sizes": infos, "repeats": args.repeats, "seed": args.seed,
              "read_gb_per_s": gb_per_s, "reference": REFERENCE, "rows": rows, "notes": notes,
              "targets": evaluate(rows)}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        from bench.plots import compare_plot

        publish("compare", result, md, args.out)
        compare_plot(result, args.out)
    return 0


# ---- the report ---------------------------------------------------------------------------------------


def _num(v, scale: float = 1.0, fmt: str = ".0f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v * scale, fmt)


def table(rows: list[dict]) -> list[str]:
    lines = ["| system | precision | batch 1 tok/s | batch 1 TTFT ms | 32 streams tok/s | TTFT p50 ms | "
             "TTFT p99 ms | peak RSS MB | exact rows | mean prefix | alone = among 32 | batch 1 ÷ bound |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bound = (f"{r['single_tokens_per_s'] / r['bound_tokens_per_s']:.0%}" if r.get("bound_tokens_per_s")
                 and r["single_tokens_per_s"] else "")
        name = f"**{r['system']}**" if r["ours"] else r["system"]
        exact = "—" if r["exact_rows"] is None else f"{r['exact_rows']}/{r['rows']}"
        alone = "—" if r.get("alone_equals_batched") is None else f"{r['alone_equals_batched']}/{r['alone_prompts']}"
        lines.append(f"| {name} | {r['precision']} | {_num(r['single_tokens_per_s'])} | "
                     f"{_num(r['single_ttft_s'], 1e3, '.1f')} | {_num(r['streams_tokens_per_s'])} | "
                     f"{_num(r['ttft_p50_s'], 1e3, '.0f')} | {_num(r['ttft_p99_s'], 1e3, '.0f')} | "
                     f"{_num(r['peak_rss_bytes'], 1e-6)} | {exact} | {_num(r['mean_prefix'], 1, '.1f')} | {alone} | "
                     f"{bound} |")
    return lines


def target_lines(targets: list[dict]) -> list[str]:
    lines = ["| size | class | target | attnserve | against | ratio | |", "|---|---|---|---:|---|---:|---|"]
    for t in targets:
        verdict = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
        if isinstance(t["ours"], tuple | list):  # agreement: (exact rows, mean prefix)
            ours = f"{t['ours'][0]} rows, {t['ours'][1]:.1f}"
            peer = f"{t['peer']}: {t['peer_value'][0]} rows, {t['peer_value'][1]:.1f}"
            ratio = ""
        else:
            ours = _num(t["ours"])
            peer = f"{t['peer']}: {_num(t['peer_value'])}" if t["peer"] else "not measured"
            ratio = "" if math.isnan(t["ratio"]) else f"{t['ratio']:.2f}×"
        lines.append(f"| {t['size']} | {t['class']} | {t['target']} | {ours} | {peer} | {ratio} | {verdict} |")
    return lines


def settings_lines(rows: list[dict]) -> list[str]:
    lines, seen = [], set()
    for r in rows:
        if r["key"] in seen:
            continue
        seen.add(r["key"])
        versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k != "python")
        settings = "; ".join(f"{k}: {shown(str(v))}" for k, v in r["settings"].items() if v is not None)
        lines.append(f"- {r['system']} {r['precision']} ({versions}): {settings}")
    return lines


def render(r: dict, argv: list[str] | None) -> str:
    cmd = shown("attnserve bench compare" + (" " + " ".join(argv) if argv else ""))
    lines = ["## attnserve against the CPU engines, three sizes, one run", "",
             f"`{cmd}` on {machine_line(r['machine'])}; read bandwidth {_num(r['read_gb_per_s'], 1, '.1f')} GB/s.", "",
             "Every system in its own process, as its users install it, on the same weights (`attnserve export-hf`, "
             "then each peer's own converter), the same prompt ids and exactly the same number of greedy tokens; "
             f"medians of {r['repeats']} rounds, each round running every system once (order rotated per round). "
             "Batch 1: prompts one after another, generated tokens/s including prefill. 32 streams: all at once, "
             "aggregate generated tokens/s; a static batch for the peers without continuous batching, whose TTFT "
             "is then the whole batch's. Exact rows / mean prefix: greedy agreement of the 32 streams with fp32 "
             "transformers. Alone = among 32: the batch-1 prompts are the first of the 32, and this counts those "
             "whose greedy ids alone were exactly their ids among the 32 (batch invariance). int8-per-tensor: "
             "attnserve's former INT8 graph (onnxruntime's dynamic quantization, one activation scale per batch), "
             "beside int8 (one scale per row). Batch 1 ÷ bound: attnserve in-process against its graph's weight "
             "bytes over the read bandwidth.", ""]
    for info in r["sizes"]:
        rows = [row for row in r["rows"] if row["size"] == info["size"]]
        lines += [f"### {info['size']}: {info['arch']}, {info['parameters'] / 1e6:.1f} M parameters, "
                  f"vocabulary {info['vocab_size']}", "",
                  f"{info['prompt_tokens']}-token prompts, {info['new_tokens']} new tokens, {info['singles']} "
                  f"batch-1 prompts, {info['streams']} streams; the size took {info['seconds'] / 60:.1f} min.", "",
                  *table(rows), ""]
    lines += ["### Targets", "", *target_lines(r["targets"]), ""]
    if r["notes"]:
        lines += ["### Skipped", "", *(f"- {shown(n)}" for n in r["notes"]), ""]
    lines += ["### Settings", "", *settings_lines(r["rows"]), "",
              "![batch 1 and 32 streams by system, one row per size](bench/compare.png)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
