"""`attnserve bench compare`: attnserve against the peers a user would otherwise pick, in one run.

    attnserve bench compare [--batches 1,8,32] [--repeats 3]
    attnserve bench compare --batches 1,2 --new-tokens 4 --repeats 1 --skip transformers,optimum --no-write  # seconds

On the default model, with the same prompts (random ids from --seed, --prompt-tokens long) and
exactly --new-tokens greedy tokens per sequence, it measures in turn:
1. Hugging Face transformers `GPT2LMHeadModel.generate`, on our weights exported to a GPT-2
   directory (`attnserve export-hf`), at each batch size;
2. optimum's `ORTModelForCausalLM.generate` on the same directory, in its own virtualenv
   (`make bench-peers`; skipped with a note when it is missing);
3. the attnserve engine in-process (all sequences submitted at once), on the graph it chooses;
4. attnserve over gRPC: `attnserve serve` in a child process, pinned to the same graph, and one
   streaming client per sequence (`bench.serve`), each sending --requests-per-client requests.
Each round runs every system once at every batch size, and the rounds repeat --repeats times, so
slow drifts of the machine fall on every system alike; the table shows medians and the ratios
between them. Peers run in their own processes with their default thread count (one per core).
It writes docs/bench/compare.json, docs/bench/compare.png (or both into --out) and the compare
section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import workload
from bench.machine import RESULTS_DIR, ROOT, describe, machine_line, publish
from bench.stats import summarize
from service.engine.config import DEFAULT_BUNDLE

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PEER_SCRIPT = ROOT / "bench" / "peers" / "generate.py"
SYSTEMS = ("transformers", "optimum", "attnserve in-process", "attnserve gRPC")
TARGETS = [  # (description, numerator system, its batch, denominator system, its batch, at least)
    ("batch 1: attnserve in-process ≥ 3× HF generate", "attnserve in-process", 1, "transformers", 1, 3.0),
    ("batch 1: attnserve in-process ≥ 2× optimum", "attnserve in-process", 1, "optimum", 1, 2.0),
    ("batch 1: attnserve over gRPC ≥ 3× HF generate", "attnserve gRPC", 1, "transformers", 1, 3.0),
    ("batch 1: attnserve over gRPC ≥ 2× optimum", "attnserve gRPC", 1, "optimum", 1, 2.0),
    ("32 gRPC streams ≥ 2× HF generate at batch 32", "attnserve gRPC", 32, "transformers", 32, 2.0),
    ("32 gRPC streams ≥ 3× optimum at batch 32", "attnserve gRPC", 32, "optimum", 32, 3.0),
    ("32 gRPC streams ≥ 0.85× the engine in-process", "attnserve gRPC", 32, "attnserve in-process", 32, 0.85),
]


def prompts_for(batch: int, prompt_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    return [item.prompt for item in workload.fixed(batch, prompt_tokens, 1, vocab, seed + batch)]


def run_peer(backend: str, python: Path, hf_dir: Path, onnx_dir: Path, spec_path: Path) -> dict:
    cmd = [str(python), str(PEER_SCRIPT), "--backend", backend, "--hf-dir", str(hf_dir), "--prompts", str(spec_path)]
    if backend == "optimum":
        cmd += ["--onnx-dir", str(onnx_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{backend} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_in_process(engine, batches: dict[int, list[list[int]]], new_tokens: int) -> dict[int, float]:
    from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

    out = {}
    for b, prompts in batches.items():
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add(engine.new_request(GenerationRequest(
                f"cmp-{b}-{i}-{start}", list(prompt), SamplingParams(temperature=0.0),
                StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))))
        generated = 0
        while engine.has_work:
            generated += sum(1 for _, item in engine.step() if item is not None)
        elapsed = time.perf_counter() - start
        if generated != b * new_tokens:
            raise RuntimeError(f"in-process generated {generated} tokens, expected {b * new_tokens}")
        out[b] = generated / elapsed
    return out


def run_grpc(address: str, batches: dict[int, list[list[int]]], new_tokens: int, requests_per_client: int) -> dict:
    from bench.serve import drive

    out = {}
    for b, prompts in batches.items():
        plan = [[workload.Item(p, new_tokens)] * requests_per_client for p in prompts]
        records = asyncio.run(drive(address, plan))
        s = summarize(records)
        if s.errors or s.short:
            raise RuntimeError(f"gRPC at {b} streams: errors {s.errors}, {s.short} short requests")
        out[b] = {"tokens_per_s": s.tokens_per_s, "ttft_s": s.ttft_s, "itl_s": s.itl_s}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attnserve bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "shakespeare", help="model directory (weights)")
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="its ONNX bundle")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="rounds over every system and batch size")
    p.add_argument("--requests-per-client", type=int, default=4, help="gRPC: requests each stream sends in a round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-python", type=Path, default=PEERS_PYTHON,
                   help="interpreter of the peers' virtualenv, with optimum (make bench-peers)")
    p.add_argument("--skip", default="", help="systems to leave out, comma-separated (transformers, optimum)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and the plot go")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    from bench.server_process import ServerProcess
    from service.engine.config import EngineConfig
    from service.engine.core import Engine

    sizes = [int(b) for b in args.batches.split(",")]
    skip = {s for s in args.skip.split(",") if s}
    notes: dict[str, str] = {}
    if "optimum" not in skip and not args.peers_python.is_file():
        skip.add("optimum")
        notes["optimum"] = f"not measured: {args.peers_python} is missing (make bench-peers)"
    if "transformers" not in skip and importlib.util.find_spec("transformers") is None:
        skip.add("transformers")
        notes["transformers"] = "not measured: transformers is not installed here (make install)"
    peers = [backend for backend in ("transformers", "optimum") if backend not in skip]
    if peers:
        try:
            from model.export_hf import export_hf  # torch and safetensors, to write the peers' GPT-2 directory
        except ImportError as e:
            print(f"attnserve bench compare needs the development install (make install): {e}", file=sys.stderr)
            return 2
    engine = Engine(EngineConfig(bundle=args.bundle, max_running=max(64, max(sizes)),
                                 max_batch_tokens=max(512, max(sizes) * (args.prompt_tokens + 1))))
    graph = engine.runner.graph_name  # the server serves the same graph, not one it may choose otherwise
    engine.warm_up()
    vocab = engine.model.vocab_size
    batches = {b: prompts_for(b, args.prompt_tokens, vocab, args.seed) for b in sizes}
    runs: dict[str, dict[int, list[float]]] = {s: {b: [] for b in sizes} for s in SYSTEMS if s not in skip}
    latency: dict[int, list[dict]] = {b: [] for b in sizes}
    versions: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="attnserve-compare-") as tmp:
        tmp = Path(tmp)
        hf_dir = export_hf(args.model, tmp / "hf") if peers else None
        spec = tmp / "prompts.json"
        spec.write_text(json.dumps({"new_tokens": args.new_tokens, "repeats": 1,
                                    "batches": {str(b): batches[b] for b in sizes}}))
        pythons = {"transformers": Path(sys.executable), "optimum": args.peers_python}
        for rnd in range(args.repeats):
            print(f"round {rnd + 1}/{args.repeats}", flush=True)
            for backend in peers:
                r = run_peer(backend, pythons[backend], hf_dir, tmp / "optimum-onnx", spec)
                versions[backend] = r["versions"]
                for b in sizes:
                    runs[backend][b] += r["tokens_per_s"][str(b)]
                print(f"  {backend:22s}", " ".join(f"b{b}={runs[backend][b][-1]:7.0f}" for b in sizes), flush=True)
            for b, tps in run_in_process(engine, batches, args.new_tokens).items():
                runs["attnserve in-process"][b].append(tps)
            print(f"  {'attnserve in-process':22s}", " ".join(f"b{b}={runs['attnserve in-process'][b][-1]:7.0f}"
                                                              for b in sizes), flush=True)
            with ServerProcess(["serve", "--bundle", str(args.bundle), "--graph", graph,
                                "--max-running", str(max(64, max(sizes)))]) as srv:
                grpc_runs = run_grpc(srv.address, batches, args.new_tokens, args.requests_per_client)
            for b, r in grpc_runs.items():
                runs["attnserve gRPC"][b].append(r["tokens_per_s"])
                latency[b].append(r)
            print(f"  {'attnserve gRPC':22s}", " ".join(f"b{b}={runs['attnserve gRPC'][b][-1]:7.0f}" for b in sizes),
                  flush=True)
    del engine

    rows = [{"system": s, "batch": b, "tokens_per_s": statistics.median(v), "runs": v}
            for s, by_b in runs.items() for b, v in by_b.items()]
    result = {"machine": describe(), "bundle": args.bundle.name, "graph": graph, "versions": versions,
              "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "seed": args.seed,
              "requests_per_client": args.requests_per_client, "rows": rows, "notes": notes,
              "targets": evaluate(rows), "ttft": ttft_check(latency)}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        from bench.plots import compare_plot

        publish("compare", result, md, args.out)
        compare_plot(rows, args.out)
    return 0


def median_of(rows: list[dict], system: str, batch: int) -> float:
    return next((r["tokens_per_s"] for r in rows if r["system"] == system and r["batch"] == batch), math.nan)


def evaluate(rows: list[dict]) -> list[dict]:
    out = []
    for text, num, nb, den, db, least in TARGETS:
        ratio = median_of(rows, num, nb) / median_of(rows, den, db)
        out.append({"target": text, "ratio": ratio, "least": least,
                    "met": None if math.isnan(ratio) else bool(ratio >= least)})
    return out


def ttft_check(latency: dict[int, list[dict]]) -> dict | None:
    """TTFT p99 at the largest concurrency against the TTFT p50 at concurrency 1 (an idle server)."""
    if 1 not in latency or len(latency) < 2 or not latency[1]:
        return None
    busy = max(latency)
    idle = statistics.median(r["ttft_s"]["p50"] for r in latency[1])
    loaded = statistics.median(r["ttft_s"]["p99"] for r in latency[busy])
    return {"idle_ttft_p50_s": idle, "streams": busy, "loaded_ttft_p99_s": loaded, "ratio": loaded / idle,
            "least": None, "most": 3.0, "met": bool(loaded / idle <= 3.0)}


def render(r: dict, argv: list[str] | None) -> str:
    cmd = "attnserve bench compare" + (" " + " ".join(argv) if argv else "")
    v = r["versions"]
    peers = "; ".join(f"{k}: " + ", ".join(f"{n} {x}" for n, x in d.items() if n != "python") for k, d in v.items())
    sizes = sorted({row["batch"] for row in r["rows"]})
    systems = list(dict.fromkeys(row["system"] for row in r["rows"]))
    lines = ["## attnserve against the peers, one run", "",
             f"`{cmd}` on {machine_line(r['machine'])}" + (f"; {peers}." if peers else "."), "",
             f"Bundle `{r['bundle']}` (attnserve serves its graph `{r['graph']}`), {r['prompt_tokens']}-token prompts "
             f"(the same ids for every system), exactly {r['new_tokens']} greedy new tokens per sequence. "
             f"Generated tokens/s, the median of {r['repeats']} rounds (each round runs every system at every "
             f"size); gRPC is N concurrent streams, each sending {r['requests_per_client']} requests, counted over "
             "the window in which all N are busy.", "",
             "| system | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for s in systems:
        lines.append(f"| {s} | " + " | ".join(f"{median_of(r['rows'], s, b):.0f}" for b in sizes) + " |")
    base = [s for s in ("transformers", "optimum") if s in systems]
    for mine in ("attnserve in-process", "attnserve gRPC"):
        for peer in base:
            lines.append(f"| *{mine} ÷ {peer}* | " + " | ".join(
                f"{median_of(r['rows'], mine, b) / median_of(r['rows'], peer, b):.2f}×" for b in sizes) + " |")
    for system, note in r["notes"].items():
        lines += ["", f"{system}: {note}."]
    lines += ["", "| target | measured | |", "|---|---|---|"]
    for t in r["targets"]:
        verdict = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
        measured = "not measured" if math.isnan(t["ratio"]) else f"{t['ratio']:.2f}×"
        lines.append(f"| {t['target']} | {measured} | {verdict} |")
    if r["ttft"]:
        t = r["ttft"]
        lines.append(f"| TTFT p99 with {t['streams']} gRPC streams ≤ 3× idle TTFT | {t['loaded_ttft_p99_s'] * 1e3:.1f} "
                     f"ms vs {t['idle_ttft_p50_s'] * 1e3:.1f} ms = {t['ratio']:.2f}× | "
                     f"{'met' if t['met'] else '**missed**'} |")
    lines += ["", "![tokens/s by system and batch size](bench/compare.png)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
