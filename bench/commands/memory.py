"""`attnserve bench memory`: the KV cache whose memory follows the tokens, at a real shape: the mechanism
in-process, then servers started with no memory flags (and with a budget) under long prompts, against
llama.cpp's server on the same weights, and a 131,072-position model.

    attnserve bench memory                                  # the qwen2.5-0.5b real shape; about 30 minutes
    attnserve bench memory --long-tokens 6000 --mixed-range 200,8000 --mixed-prompts 32    # the full workload
    attnserve bench memory --parts mechanism --bundle models/shakespeare-onnx --contexts 64,128 --no-write
    attnserve bench memory --quick --bundle <tiny bundle> --out /tmp/x                      # seconds

The bundle is a real-shape random-weight model (bench/real_shapes.py builds them under
~/.cache/attnserve/real-shapes/<name>/: `bundle`, and the Hugging Face directory `hf` beside it). Parts
(`--parts`, default all; a part whose bundle or program is missing is skipped and says why; parts not run keep
their last results from --out, each with the command that made it):

1. mechanism: the decode step at --batch rows and each of --contexts on lazily paged buffers (now) against
   np.zeros buffers of the same shape (the allocate-once layout), in interleaved rounds; what releasing a
   slot of --release-positions positions costs; resident memory as it is written and released
   (`bench.kv_mechanism`).
2. server: `attnserve serve --bundle B --graph G` with no memory flags, for each of --graphs (auto, and
   static-int8 with --allow-low-agreement, skipped if auto chose it): time to SERVING, the start-up log's budget
   and KV tokens, peak RSS, and two workloads, each submitted at once over /v1/completions: (a) --long-prompts
   prompts of --long-tokens random ids, 16 new tokens each; (b) --mixed-prompts prompts of lengths uniform in
   --mixed-range, 32 new tokens each.
3. beside: the last of --graphs, no memory flags: --streams streams of 32-token prompts decode, and once each has
   its first message a --beside-tokens prompt is sent: its TTFT, and the streams' inter-token latency while it is
   prefilled (one chunk of it a step).
4. budget: the last of --graphs with --memory-budget (default 12GiB): the tokens that fit, the same workloads.
5. llama: `llama-server -m <gguf> -c <context> -np <slots> --kv-unified -t <cores>` on the GGUF of --hf-dir
   (--llama-precision), the same workloads over its /v1/completions.
6. long-context: --long-bundle (the llama-131k real shape) with no memory flags: its log, SERVING, and one
   --long-context-tokens prompt.

Every request is a streamed `POST /v1/completions` of token ids with ignore_eos (`bench.serve_http.HttpLoad`),
the same client for every server; prompts are random ids, all different, so no prefix cache helps. Writes
docs/bench/memory.json and the memory section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from attnserve.arguments import HintingParser
from bench import workload
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from bench.memory_render import ms, render_section
from service.runtime.memory import budget_bytes, memory_limit

REAL_SHAPES = Path.home() / ".cache" / "attnserve" / "real-shapes"
PARTS = ("mechanism", "server", "beside", "budget", "llama", "long-context")
GiB = 2**30
RATIO_TARGET = 0.9  # the lazy layout's decode speed over the allocated one's


def cpu_facts() -> dict:
    """The CPU as `lscpu` names it and the kernel-selecting flags /proc/cpuinfo lists."""
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), None)
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return {"model_name": model, "flags": [f for f in wanted if f in flags]}


def parse_args(argv: list[str] | None):
    p = HintingParser(prog="attnserve bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=REAL_SHAPES / "qwen2.5-0.5b" / "bundle")
    p.add_argument("--hf-dir", type=Path, help="the bundle's Hugging Face directory, for llama.cpp's GGUF "
                                               "(default: `hf` beside the bundle)")
    p.add_argument("--long-bundle", type=Path, help="the long-context model of part long-context (default: the "
                                                    "llama-131k real shape; none with --quick)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="sizes for a tiny bundle (context 128): seconds")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads in-process (0 = one per core)")
    g = p.add_argument_group("mechanism")
    g.add_argument("--mechanism-graph", default="static", help="the graph of the decode comparison")
    g.add_argument("--batch", type=int, default=32)
    g.add_argument("--contexts", default="64,512")
    g.add_argument("--slot-positions", type=int, default=2048, help="positions per slot of both layouts "
                   "(capped at the model's context)")
    g.add_argument("--rounds", type=int, default=5)
    g.add_argument("--steps", type=int, default=6, help="timed decode steps per layout, context and round")
    g.add_argument("--release-positions", type=int, default=8000)
    g = p.add_argument_group("servers")
    g.add_argument("--graphs", default="auto,static-int8", help="serving graphs of part server, in turn; a graph "
                   "that auto already served is skipped; the last one serves parts beside and budget")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `attnserve serve` argument for every attnserve server")
    g.add_argument("--long-prompts", type=int, default=8)
    g.add_argument("--long-tokens", type=int, default=2000)
    g.add_argument("--mixed-prompts", type=int, default=16)
    g.add_argument("--mixed-range", default="200,2000", help="lo,hi: prompt lengths uniform in [lo, hi]")
    g.add_argument("--beside-tokens", type=int, default=30000, help="the long prompt beside the streams")
    g.add_argument("--streams", type=int, default=8)
    g.add_argument("--budget", default="12GiB", help="--memory-budget of part budget")
    g.add_argument("--long-context-tokens", type=int, default=20000)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("llama.cpp")
    g.add_argument("--llama-precision", default="q8_0", choices=("f16", "q8_0"))
    g.add_argument("--llama-context", type=int, help="-c: total KV cells (default: the tokens attnserve's budget "
                                                     "run held, at most what fits in half the available memory)")
    g.add_argument("--llama-slots", type=int, default=32)
    g.add_argument("--llama-timeout-s", type=float, default=1800.0, help="a llama.cpp stream silent this long (its "
                   "prompt not yet prefilled) ends as an error: on a busy machine its threads can crawl")
    g.add_argument("--llama-work", type=Path, default=Path("runs") / "llama-cpp-memory")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where memory.json goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in dict(contexts="16,32", slot_positions=128, rounds=2, steps=2, release_positions=100,
                                long_prompts=2, long_tokens=40, mixed_prompts=4, mixed_range="8,60", beside_tokens=80,
                                streams=2, budget="1GiB", long_context_tokens=60, graphs="auto").items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.parts = [part.strip() for part in args.parts.split(",")]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"--parts: {', '.join(sorted(unknown))} not among {', '.join(PARTS)}")
    args.hf_dir = args.hf_dir or args.bundle.parent / "hf"
    if args.long_bundle is None and not args.quick:
        args.long_bundle = REAL_SHAPES / "llama-131k" / "bundle"
    return args


def mechanism(args, progress=print) -> dict:
    from bench.kv_mechanism import decode_ratio, release_and_residency
    from service.runtime.static_runner import StaticRunner

    runner = StaticRunner(args.bundle, args.mechanism_graph, provider="cpu", intra_op_threads=args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    positions = min(args.slot_positions, runner.cache_shape.max_seq)
    m = runner.manifest.model
    result = {"bundle": m.name, "shape": {"layers": m.n_layer, "d_model": m.d_model, "heads": m.n_head,
                                          "kv_heads": m.kv_heads, "d_head": m.d_head, "vocab": m.vocab_size,
                                          "context": m.n_ctx},
              "decode": decode_ratio(runner, args.batch, contexts, positions, args.rounds, args.steps, progress)}
    shape = runner.cache_shape
    del runner
    result["release"] = release_and_residency(shape, args.release_positions, args.rounds)
    r = result["release"]
    progress(f"release of {r['positions']} positions: {r['release_ms']:.2f} ms (moved: {r['release_moved_ms']:.2f} "
             f"ms); RSS +{(r['rss_written'] - r['rss_before']) / 2**20:.0f} MiB written, "
             f"{(r['rss_released'] - r['rss_before']) / 2**20:+.0f} MiB after release")
    return result


def serve_args(args, bundle: Path, graph: str, budget: str | None = None) -> list[str]:
    out = ["--bundle", str(bundle), "--graph", graph]
    if graph != "auto":
        out.append("--allow-low-agreement")  # random weights: the INT8 graph's agreement with fp32 is low
    if budget:
        out += ["--memory-budget", budget]
    return out + list(args.server_arg)


def served_run(args, argv: list[str], log_dir: Path, name: str, items: dict[str, list[workload.Item]] | None,
               budget: str | None = None, beside: tuple | None = None, progress=print) -> dict:
    """One attnserve server: start-up, its memory plan, the workloads (`items`), `beside` (the long prompt and its
    streams), peak RSS."""
    from bench.memory_runs import Served

    limit = memory_limit()
    run = {"command": "attnserve serve " + " ".join(argv), "budget_setting": budget or "0.65 (default)",
           "budget_bytes": budget_bytes(budget or "0.65", limit), "limit": {"bytes": limit.bytes,
                                                                             "source": limit.source}}
    with Served(argv, log_dir, name) as s:
        run.update(startup_s=s.startup_s, model=s.model(), plan=s.plan())
        progress(f"{name}: SERVING after {s.startup_s:.1f} s, graph {run['model']['graph']}; "
                 f"{run['plan']['budget_line']}; {run['plan']['kv_line']}")
        for phase, phase_items in (items or {}).items():
            s.workload(phase, phase_items)
            progress(f"{name} {phase}: {phase_line(s.phases[phase])}")
        if beside:
            s.long_beside_streams(*beside)
            b = s.phases["long_beside_streams"]
            progress(f"{name} long prompt beside streams: {phase_line(b['long'])}; streams' ITL while it prefills "
                     f"{ms(b['streams']['itl_during_prefill_s']['p50'])}/{ms(b['streams']['itl_during_prefill_s']['p99'])}"
                     f" (max {ms(b['streams']['itl_during_prefill_s']['max'])})")
        run["phases"] = s.phases
    run["peak_rss_bytes"] = s.peak_rss
    plan = run["plan"]
    if s.least_free is not None and plan["kv_tokens"] and plan["model_gib"] is not None:
        # what the peak holds beyond the model and the most KV the sequences held: the activations, at most
        held = (plan["kv_tokens"] - s.least_free) * plan["kv_bytes_per_token"]
        run["kv_held_max_bytes"] = held
        run["peak_beyond_model_and_kv_bytes"] = s.peak_rss - plan["model_gib"] * GiB - held
    run["log"] = str(s.server.logs[-1])
    run["within_budget"] = bool(s.peak_rss <= run["budget_bytes"])
    progress(f"{name}: peak RSS {s.peak_rss / GiB:.2f} GiB of a {run['budget_bytes'] / GiB:.2f} GiB budget")
    return run


def workloads(args, vocab: int) -> dict[str, list[workload.Item]]:
    from bench.memory_runs import mixed_items

    lo, hi = (int(x) for x in args.mixed_range.split(","))
    items = {"long": workload.fixed(args.long_prompts, args.long_tokens, 16, vocab, args.seed),
             "mixed": mixed_items(args.mixed_prompts, lo, hi, 32, vocab, args.seed + 1)}
    return {name: some for name, some in items.items() if some}  # --long-prompts 0 or --mixed-prompts 0: not run


def server_parts(args, result: dict, log_dir: Path, save, progress=print) -> None:
    from service.runtime.bundle import read_manifest

    manifest = read_manifest(args.bundle)
    vocab, context = manifest.model.vocab_size, manifest.model.n_ctx
    items = workloads(args, vocab)
    beside = (workload.fixed(1, min(args.beside_tokens, context - 32), 16, vocab, args.seed + 2)[0],
              workload.fixed(args.streams, 32, stream_tokens(args, context), vocab, args.seed + 3))
    graphs = [g.strip() for g in args.graphs.split(",")]
    served_graphs: list[str] = []
    if "server" in args.parts:
        runs = []
        for graph in graphs:
            if graph in served_graphs:
                progress(f"--graph {graph}: auto already served it")
                continue
            run = served_run(args, serve_args(args, args.bundle, graph), log_dir, f"serve-{graph}", items,
                             progress=progress)
            run["graph_asked"] = graph
            served_graphs.append(run["model"]["graph"])
            runs.append(run)
        result["server"] = {"command": command_line(args), "runs": runs}
        save()
    if "beside" in args.parts:
        run = served_run(args, serve_args(args, args.bundle, graphs[-1]), log_dir, "serve-beside", None,
                         beside=beside, progress=progress)
        result["beside"] = {"command": command_line(args), "runs": [run]}
        save()
    if "budget" in args.parts:
        graph = graphs[-1]
        run = served_run(args, serve_args(args, args.bundle, graph, args.budget), log_dir, "serve-budget", items,
                         budget=args.budget, progress=progress)
        result["budget"] = {"command": command_line(args), "runs": [run]}
        save()
    if "llama" in args.parts:
        result["llama"] = {"command": command_line(args), **llama_part(args, result, items, progress)}


def stream_tokens(args, context: int) -> int:
    """New tokens for each stream beside the long prompt: enough to decode through its whole prefill (one chunk of
    at most 512 - streams positions a step) and some after."""
    chunk = 512 - args.streams
    return min(-(-args.beside_tokens // chunk) + 64, context - 64)


def llama_part(args, result: dict, items: dict, progress=print) -> dict:
    from bench.memory_runs import LlamaServed
    from bench.peers import llama_cpp
    from service.runtime.bundle import read_manifest

    reason = llama_cpp.available()
    if reason is None and not (args.hf_dir / "config.json").is_file():
        reason = f"no Hugging Face directory at {args.hf_dir} (--hf-dir)"
    if reason:
        progress(f"llama.cpp: skipped: {reason}")
        return {"skipped": reason}
    m = read_manifest(args.bundle).model
    per_token_f16 = 2 * m.n_layer * m.kv_heads * m.d_head * 2  # its default KV type, f16
    fits = int(available_bytes() * 0.5) // per_token_f16
    budget_runs = result.get("budget", {}).get("runs") or [{}]
    wanted = args.llama_context or (budget_runs[0].get("plan") or {}).get("kv_tokens") or fits
    context = min(wanted, fits) if not args.llama_context else wanted
    gguf = llama_cpp.convert(args.hf_dir, args.llama_work, args.llama_precision)
    bin_dir, _ = llama_cpp.where()
    threads = llama_cpp.cores()
    log = args.llama_work / f"{gguf.stem}-memory-server.log"
    source = ("given by --llama-context" if args.llama_context else "the tokens attnserve's budget run held"
              if budget_runs[0].get("plan") else "what fits in half the memory available")
    out = {"precision": args.llama_precision, "gguf": gguf.name, "context": context, "context_wanted": wanted,
           "context_source": source,
           "slots": args.llama_slots, "threads": threads, "versions": llama_cpp.versions(bin_dir),
           "timeout_s": args.llama_timeout_s}
    with LlamaServed(bin_dir, gguf, context, args.llama_slots, threads, log) as server:
        out.update(server_command=server.command, startup_s=server.startup_s)
        progress(f"llama.cpp: `{server.command}` ready after {server.startup_s:.1f} s")
        for phase, phase_items in items.items():
            server.workload(phase, phase_items, args.llama_timeout_s)
            progress(f"llama.cpp {phase}: {phase_line(server.phases[phase])}")
        out["phases"] = server.phases
        out["log_facts"] = server.log_facts()
    out["peak_rss_bytes"] = server.peak_rss
    progress(f"llama.cpp: peak RSS {server.peak_rss / GiB:.2f} GiB")
    return out


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def long_context_part(args, log_dir: Path, progress=print) -> dict:
    from service.runtime.bundle import read_manifest

    if args.long_bundle is None or not (args.long_bundle / "bundle.json").is_file():
        reason = f"no bundle at {args.long_bundle} (--long-bundle)"
        progress(f"long-context: skipped: {reason}")
        return {"skipped": reason}
    m = read_manifest(args.long_bundle).model
    prompt = workload.fixed(1, min(args.long_context_tokens, m.n_ctx - 32), 16, m.vocab_size, args.seed + 4)
    argv = ["--bundle", str(args.long_bundle), *args.server_arg]
    run = served_run(args, argv, log_dir, "serve-long-context", {"one long prompt": prompt}, progress=progress)
    return {"command": command_line(args), "runs": [run]}


def command_line(args) -> str:
    return " ".join(["attnserve bench memory", *(shlex.quote(a) for a in args.argv)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(argv or [])
    out_json = args.out / "memory.json"
    previous = json.loads(out_json.read_text()) if out_json.is_file() else {}
    result = {"machine": describe(), "cpu": cpu_facts(), "checks": {}}
    result.update({part: previous[part] for part in PARTS if part in previous and part not in args.parts})

    def save() -> None:
        if not args.no_write:
            publish("memory", result, render(result), args.out)

    with tempfile.TemporaryDirectory(prefix="attnserve-bench-memory-") as tmp:
        log_dir = Path(os.environ.get("ATTNSERVE_BENCH_LOGS", tmp))
        if "mechanism" in args.parts:
            result["mechanism"] = {"command": command_line(args), **mechanism(args)}
            save()
        if {"server", "beside", "budget", "llama"} & set(args.parts):
            server_parts(args, result, log_dir, save)
        if "long-context" in args.parts:
            result["long-context"] = long_context_part(args, log_dir)
    result["checks"], result["targets"] = checks(result), targets(result)
    save()
    print(render(result))
    return 0 if all(result["checks"].values()) else 1


def targets(r: dict) -> dict[str, bool]:
    """Speed: the lazy layout decodes within 10% of the allocated one (reported; a noisy machine can miss it)."""
    if "mechanism" not in r:
        return {}
    ratios = r["mechanism"]["decode"]["speed_ratio"]
    return {f"decode speed now / before >= {RATIO_TARGET} at context {c}": v >= RATIO_TARGET for c, v in ratios.items()}


def checks(r: dict) -> dict[str, bool]:
    """What must hold (the exit code): every request completes with no error, and no attnserve server's peak RSS
    exceeds its budget."""
    out = {}
    for part in ("server", "beside", "budget", "long-context"):
        for run in (r.get(part) or {}).get("runs", []):
            name = f"{part} {run['model']['graph']}"
            out[f"{name}: every request completed"] = all(
                ph["completed"] == ph["requests"] and not ph["errors"] for ph in flat_phases(run["phases"]))
            out[f"{name}: peak RSS within the budget"] = run["within_budget"]
    return out


def flat_phases(phases: dict) -> list[dict]:
    out = []
    for name, ph in phases.items():
        out += [ph["long"], ph["streams"]] if name == "long_beside_streams" else [ph]
    return out


# ---- the section ---------------------------------------------------------------------------------------------

def phase_line(ph: dict) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in ph["errors"].items()) or "none"
    running = ph.get("max_running")
    return (f"{ph['completed']}/{ph['requests']} completed, errors {errors}, "
            f"TTFT p50 {ph['ttft_s']['p50']:.1f} s, per 1k prompt tokens p50/p90 {ph['ttft_per_1k_s']['p50']:.2f}/"
            f"{ph['ttft_per_1k_s']['p90']:.2f} s, wall {ph['wall_s']:.0f} s"
            + (f", at most {running} running" if running is not None else "")
            + (f", preemptions {ph['preemptions']:.0f}" if "preemptions" in ph else ""))


def render(r: dict) -> str:
    return render_section(r, machine_line(r["machine"]), shown)


if __name__ == "__main__":
    raise SystemExit(main())
