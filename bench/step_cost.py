"""What a decode step costs beyond its graph call: the engine's own Python (scheduling, sampling, outputs, the
detokenizer) against the time onnxruntime spends in the decode graph, in-process, at batch B.

    python -m bench.step_cost --bundle $(python -m bench.real_shapes path qwen2.5-0.5b) --graph static-int8
    python -m bench.step_cost --batches 1,8 --prompt 512 --new-tokens 64 --repeats 3

Each round submits B requests with the same random prompt of P ids (greedy, ignore_eos, N new tokens) and times
every engine step whose only graph call is one decode; a step's Python is its wall time less that call's. Medians
over the decode steps of every round; the JSON goes to stdout (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench.machine import describe
from service.engine.config import DEFAULT_BUNDLE, EngineConfig
from service.engine.core import Engine
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria


class CallTimes:
    """Wraps a runner's graph calls: how long each took since `clear`, by method."""

    def __init__(self, runner, methods: tuple[str, ...] = ("decode", "prefill", "prefill_batch")):
        self.calls: list[tuple[str, float]] = []
        for name in methods:
            setattr(runner, name, self._timed(name, getattr(runner, name)))

    def _timed(self, name: str, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.calls.append((name, time.perf_counter() - start))
        return timed

    def clear(self) -> None:
        self.calls.clear()


def measure(engine: Engine, calls: CallTimes, batch: int, prompt: int, new_tokens: int, seed: int
            ) -> list[tuple[float, float]]:
    """(step seconds, decode-call seconds) of each engine step that ran exactly one decode call and nothing else."""
    ids = np.random.default_rng(seed).integers(1, engine.sampleable, prompt).tolist()
    for i in range(batch):
        engine.add(engine.new_request(GenerationRequest(
            f"s{seed}-{i}", ids, SamplingParams(temperature=0.0),
            StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))))
    steps = []
    while engine.has_work:
        calls.clear()
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if [name for name, _ in calls.calls] == ["decode"]:
            steps.append((wall, calls.calls[0][1]))
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    p.add_argument("--graph", default="auto")
    p.add_argument("--batches", default="1,8", help="concurrent requests of each measurement")
    p.add_argument("--prompt", type=int, default=512, help="prompt ids per request")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    engine = Engine(EngineConfig(bundle=args.bundle, graph=args.graph, allow_low_agreement=True,
                                 max_running=max(batches), prefix_caching=False))
    engine.warm_up()
    calls = CallTimes(engine.runner)
    result = {"machine": describe(), "bundle": str(args.bundle), "graph": engine.runner.graph_name,
              "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats, "batches": {}}
    for batch in batches:
        steps = [s for r in range(args.repeats) for s in measure(engine, calls, batch, args.prompt, args.new_tokens, r)]
        wall = statistics.median(w for w, _ in steps)
        graph = statistics.median(g for _, g in steps)
        python = statistics.median(w - g for w, g in steps)
        result["batches"][batch] = {"steps": len(steps), "step_ms": round(wall * 1e3, 3),
                                    "graph_ms": round(graph * 1e3, 3), "python_ms": round(python * 1e3, 3),
                                    "python_share": round(python / wall, 4)}
        print(f"batch {batch}: step {wall * 1e3:.2f} ms, decode graph {graph * 1e3:.2f} ms, "
              f"the rest {python * 1e3:.3f} ms ({python / wall:.1%}), {len(steps)} steps", flush=True)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
