"""`python -m bench.op_profile`: where a decode step's or a long prefill's time goes, by operator, for graphs
of one bundle.

    python -m bench.op_profile --bundle runs/compare/gpt2-124m/bundle --graphs static-int8,static-int8-per-tensor
    python -m bench.op_profile --bundle ~/.cache/attnserve/real-shapes/qwen2.5-0.5b/bundle \
        --graphs static-int8,static --prefill 4096 --chunk 512

Each graph decodes `--steps` greedy steps at each batch size of `--batches` (after an 8-token prefill and
one untimed step) with onnxruntime's profiler on; the table gives each operator type's kernel time per
step (µs, the median over steps) and the step's total. Graphs and batch sizes are run in interleaved
rounds, as `attnserve bench quantization` times them. Kernel times under the profiler run a little
slower than without it: read the shares and the differences between graphs, not the totals.

With `--prefill N`, each graph instead writes one random N-token prompt in chunks of `--chunk` tokens (the
engine's `max_batch_tokens`, 512 by default), as the engine prefills a long prompt, after one untimed chunk; the
table gives each operator type's kernel seconds over the whole prompt (the median over rounds) and its share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.runtime.graph_choice import decode_step_ms
from service.runtime.static_runner import StaticRunner


def profiled(bundle: Path, graph: str, folder: Path) -> StaticRunner:
    """The graph's runner, its session replaced by the same graph with the profiler on."""
    runner = StaticRunner(bundle, graph, provider="cpu")
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / graph)
    runner.session = ort.InferenceSession(str(bundle / runner.spec.file), options,
                                          providers=["CPUExecutionProvider"])
    return runner


def per_step(events: list[dict], skip_runs: int) -> list[dict[str, float]]:
    """Kernel µs by operator type for each model run after the first `skip_runs`."""
    runs = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    steps: list[dict[str, float]] = [defaultdict(float) for _ in runs[skip_runs:]]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = sum(1 for start in runs if start <= e["ts"]) - 1 - skip_runs
        if 0 <= i < len(steps):
            steps[i][e["args"]["op_name"]] += e["dur"]
    return steps


def prefill_chunks(runner: StaticRunner, tokens: int, chunk: int, seed: int = 0) -> None:
    """One untimed chunk, then a random `tokens`-token prompt written `chunk` tokens at a time into slot 0."""
    ids = np.random.default_rng(seed).integers(0, runner.vocab_size, tokens).tolist()
    with runner.scratch_cache(1, tokens + 1):
        runner.prefill(0, ids[:chunk], 0)
        for start in range(0, tokens, chunk):
            runner.prefill(0, ids[start:start + chunk], start)


def prefill_table(bundle: Path, graphs: list[str], tokens: int, chunk: int, rounds: int) -> None:
    samples: dict[str, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for graph in graphs:
                runner = profiled(bundle, graph, Path(tmp))
                prefill_chunks(runner, tokens, chunk)
                events = json.loads(Path(runner.session.end_profiling()).read_text())
                steps = per_step(events, skip_runs=1)  # the untimed chunk
                samples[graph].append({op: sum(s.get(op, 0.0) for s in steps) for op in {o for s in steps for o in s}})
    ops = sorted({op for g in graphs for run in samples[g] for op in run})
    median = {g: {op: statistics.median(r.get(op, 0.0) for r in samples[g]) / 1e6 for op in ops} for g in graphs}
    total = {g: sum(median[g].values()) for g in graphs}
    print(f"\nprefill of {tokens} tokens in chunks of {chunk}: kernel seconds (share), median of {rounds} rounds")
    print("| operator | " + " | ".join(graphs) + " |")
    print("|---" * (len(graphs) + 1) + "|")
    for op in sorted(ops, key=lambda o: -max(median[g][o] for g in graphs))[:12]:
        print(f"| {op} | " + " | ".join(f"{median[g][op]:.2f} ({median[g][op] / total[g]:.0%})" for g in graphs) + " |")
    print("| **total** | " + " | ".join(f"{total[g]:.2f}" for g in graphs) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.op_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--graphs", required=True, help="comma-separated graph names")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", type=int, help="profile a prefill of this many tokens instead of decode steps")
    p.add_argument("--chunk", type=int, default=512, help="with --prefill: tokens per call")
    args = p.parse_args(argv)
    graphs, batches = args.graphs.split(","), [int(b) for b in args.batches.split(",")]
    if args.prefill:
        prefill_table(args.bundle, graphs, args.prefill, args.chunk, args.rounds)
        return 0
    samples: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for graph in graphs:
                for batch in batches:
                    runner = profiled(args.bundle, graph, Path(tmp))
                    decode_step_ms(runner, batch, args.steps)
                    events = json.loads(Path(runner.session.end_profiling()).read_text())
                    samples[graph, batch] += per_step(events, skip_runs=2)  # the prefill, the untimed step
    for batch in batches:
        ops = sorted({op for g in graphs for step in samples[g, batch] for op in step})
        median = {g: {op: statistics.median(s.get(op, 0.0) for s in samples[g, batch]) for op in ops} for g in graphs}
        print(f"\nbatch {batch}: kernel µs per decode step, median of {args.rounds * args.steps} steps")
        print("| operator | " + " | ".join(graphs) + " |")
        print("|---" * (len(graphs) + 1) + "|")
        for op in sorted(ops, key=lambda o: -max(median[g][o] for g in graphs)):
            print(f"| {op} | " + " | ".join(f"{median[g][op]:.0f}" for g in graphs) + " |")
        print("| **total** | " + " | ".join(f"{sum(median[g].values()):.0f}" for g in graphs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
