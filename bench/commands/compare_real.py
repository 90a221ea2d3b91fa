"""`attnserve bench compare --real-shapes`: attnserve against llama.cpp at the sizes people serve, at the prompt
lengths and concurrencies they serve them at.

    attnserve bench compare --real-shapes                  # qwen2.5-0.5b, qwen2.5-1.5b, llama-3.2-1b; 2 rounds
    attnserve bench compare --real-shapes --shapes qwen2.5-0.5b --prefill 512 --decode-after 512 \\
        --decode-batches 1 --new-tokens 8 --repeats 1 --graphs static-int8 --no-write
    attnserve bench compare --real-shapes --quick --no-write     # a tiny shape, every code path, a minute

Each shape is a random-weight model at a real shape (bench/real_shapes.py, built once and reused): attnserve
serves its bundle, llama.cpp its GGUFs made from the same Hugging Face checkpoint by llama.cpp's converter
(f16, q8_0; q4_0 by llama-quantize from an f32 GGUF, deleted once it is made). The systems, each in a process of
its own for each round:

1. attnserve over gRPC, one per --graphs: `attnserve serve --graph G --allow-low-agreement` (random weights may
   miss the start-up agreement bar), prefix caching on, --max-running at least 32, --max-context the longest
   sequence the plan makes.
2. attnserve out of the box: `attnserve serve --bundle B` and nothing else; it picks its own graph (reported).
3. llama.cpp batched-bench at f16, q8_0 and q4_0, -t/-tb one per core, -fa on, -ub 512 -b 2048.
4. llama.cpp server (-fa on, --parallel 32, --cont-batching, one unified KV cache as large as the most
   positions in flight), at the precision batched-bench prefilled fastest at the prefill target in round 1.

What each measures (bench/real_runs.py; the arithmetic is bench/real_report.py's):
- prefill tokens/s at each --prefill length: one request of P random ids and 1 new token, P / TTFT (client
  side; attnserve's own TTFT from its metrics beside it); batched-bench: its S_PP (-ntg 1 -npl 1);
- decode tokens/s at each of --decode-batches streams after each --decode-after prompt: B streams at once with
  the same prompt (sent once before with 1 new token, so a prefix cache holds it), --new-tokens greedy tokens
  each (exactly: ignore_eos); tokens received while all B decode over that window (`decode_rate`; where a
  server never ran all B at once, the sum of each stream's own rate, marked in the table);
  batched-bench: its S_TG with the prompt shared (-pps);
- the servers' TTFT p50/p99 under a mixed load: --mixed-requests distinct prompts, lengths uniform in
  --mixed-range (seeded), one every --mixed-interval seconds, --mixed-new-tokens each;
- peak RSS (VmHWM) of each system's process;
- batch-1 decode after the --decode-after point nearest 512 against the read bandwidth (measured once a run):
  bytes of weights read per token (attnserve: bench/roofline.py on its graph; llama.cpp: the GGUF's tensors,
  the embedding counted when the head is tied to it) × tokens/s, over GB/s.

Rounds: --repeats; in each, every shape runs every system once, in an order rotated by one a round; the report
shows medians over rounds. To keep a run within hours on 2 cores, rounds after the first leave out a llama.cpp
precision below 80% of the best one at every measure of round 1, and batched-bench prefills beyond the prefill
target (16,000 tokens) only at the precision fastest at the target. The targets (`bench.real_report.TARGETS`):
attnserve's best named graph and attnserve out of the box against llama.cpp's best, per shape.

Progress goes to stdout as it runs, and the JSON is rewritten after every run (a killed run keeps what it
measured): docs/bench/compare-real.json (or --out), then the compare-real section of docs/BENCHMARKS.md. With
--no-write, the JSON goes to --work only. A llama.cpp that is not built is skipped with one line.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from attnserve.arguments import HintingParser
from bench.commands.compare import QUICK_SHAPES, rotated
from bench.machine import RESULTS_DIR, ROOT, describe, publish
from bench.real_report import (
    FAMILIES,
    QUICK_POINTS,
    REAL_POINTS,
    SLOW,
    evaluate,
    fastest_precision,
    nearest,
    render,
    slow_precisions,
    summarize,
)
from bench.real_runs import Plan
from bench.roofline import graph_weight_bytes_per_token

SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b")
PRECISIONS = ("f16", "q8_0", "q4_0")  # llama.cpp's GGUFs
SERVER_FALLBACK = "q4_0"  # llama.cpp's server precision when round 1 measured no batched-bench prefill
QUICK_SHAPE = "smollm2-135m"  # bench.sizes' tiny Llama-family shape (QUICK_SHAPES), built in seconds
QUICK_QK_GAIN = 2.5  # its few narrow layers need sharper attention to decode varied tokens (tests/bench/test_sizes.py)
LEAST_RUNNING = 32  # attnserve's --max-running with the named graphs
CONTEXT_MARGIN = 16  # positions beyond the longest sequence


@dataclass(frozen=True)
class System:
    key: str  # e.g. attnserve:static-int8, llama.cpp-batched:q4_0
    family: str  # one of bench.real_report.FAMILIES
    variant: str | None  # the graph or the GGUF's precision; None where the run picks it

    @property
    def label(self) -> str:
        return FAMILIES[self.family] + (f" {self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Shape:
    name: str
    hf_dir: Path  # the transformers checkpoint llama.cpp converts
    bundle: Path  # attnserve's bundle of the same weights
    architecture: str
    parameters: int
    n_ctx: int  # positions the model has
    vocab: int


def all_systems(graphs: list[str]) -> list[System]:
    """In round 1's order: batched-bench before the server, which runs the precision it found fastest."""
    return ([System(f"attnserve:{g}", "attnserve", g) for g in graphs]
            + [System("attnserve-default", "attnserve-default", None)]
            + [System(f"llama.cpp-batched:{p}", "llama.cpp-batched", p) for p in PRECISIONS]
            + [System("llama.cpp-server", "llama.cpp-server", None)])


def select(systems: list[System], only: str, skip: str) -> list[System]:
    """The systems named (keys or families) in `only` (all if empty), less those in `skip`."""
    names = {s.key for s in systems} | {s.family for s in systems}
    wanted, dropped = [n for n in only.split(",") if n], [n for n in skip.split(",") if n]
    unknown = sorted(set(wanted + dropped) - names)
    if unknown:
        raise ValueError(f"unknown systems {unknown}; the systems are {sorted(names)}")
    return [s for s in systems if (not wanted or s.key in wanted or s.family in wanted)
            and s.key not in dropped and s.family not in dropped]


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


# ---- the shapes -------------------------------------------------------------------------------------------------


def safetensors_parameters(hf_dir: Path) -> int:
    """Parameters of a checkpoint, from its safetensors headers (a tied head is stored once)."""
    total = 0
    for f in sorted(hf_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(math.prod(tensor["shape"]) for name, tensor in header.items() if name != "__metadata__")
    return total


def prepare_shape(name: str, quick: bool, work: Path) -> Shape:
    if quick:
        from bench.sizes import prepare

        p = prepare(QUICK_SHAPE, work, shape=QUICK_SHAPES[QUICK_SHAPE], qk_gain=QUICK_QK_GAIN)
        return Shape(f"{QUICK_SHAPE}-quick", p.hf_dir, p.bundle, "LlamaForCausalLM", p.parameters, p.n_ctx,
                     p.vocab_size)
    from bench import real_shapes

    built = real_shapes.build(name)
    shape = real_shapes.SHAPES[name]
    return Shape(name, built.hf_dir, built.bundle, shape.architecture, safetensors_parameters(built.hf_dir),
                 shape.config["max_position_embeddings"], real_shapes.VOCAB)


def make_plan(args, vocab: int) -> Plan:
    from bench.memory_runs import mixed_items

    lo, hi = ints(args.mixed_range)
    mixed = mixed_items(args.mixed_requests, lo, hi, args.mixed_new_tokens, vocab, args.seed)
    return Plan(ints(args.prefill), ints(args.decode_after), ints(args.decode_batches), args.new_tokens,
                tuple(mixed), args.mixed_interval, vocab, args.seed)


# ---- one run --------------------------------------------------------------------------------------------------


class Comparison:
    """The whole run's state: what was measured, the rules' decisions, and the JSON rewritten after each run."""

    def __init__(self, args, argv: list[str] | None, systems: list[System], log=None):
        self.args, self.argv, self.systems, self.log = args, argv, systems, log or say
        self.points = QUICK_POINTS if args.quick else REAL_POINTS
        self.notes: list[str] = []
        self.runs: list[dict] = []
        self.shapes: dict[str, Shape] = {}
        self.plans: dict[str, Plan] = {}
        self.first_round: dict[str, dict[str, dict]] = {}  # shape -> precision -> its round-1 batched-bench run
        self.dropped: dict[str, set[str]] = {}  # shape -> system keys left out from here on
        self.llama_bin: Path | None = None
        self.gb_per_s: float | None = None
        self.versions: dict = {}
        self.started = time.perf_counter()

    @property
    def ref_prefill(self) -> int:
        return nearest(ints(self.args.prefill), self.points.prefill)

    def json_path(self) -> Path:
        return (self.args.work if self.args.no_write else self.args.out) / "compare-real.json"

    def result(self, complete: bool) -> dict:
        rows = summarize(self.runs)
        plan = next(iter(self.plans.values()), None)
        lo, hi = ints(self.args.mixed_range)
        return {"machine": describe(), "complete": complete, "repeats": self.args.repeats, "seed": self.args.seed,
                "read_gb_per_s": self.gb_per_s, "versions": self.versions,
                "bandwidth_after": nearest(ints(self.args.decode_after), REAL_POINTS.after),
                "plan": {"prefill": list(ints(self.args.prefill)), "decode_after": list(ints(self.args.decode_after)),
                         "batches": list(ints(self.args.decode_batches)), "new_tokens": self.args.new_tokens,
                         "mixed": {"requests": len(plan.mixed) if plan else self.args.mixed_requests, "lo": lo,
                                   "hi": hi, "new_tokens": self.args.mixed_new_tokens,
                                   "interval_s": self.args.mixed_interval}},
                "shapes": [{"shape": s.name, "architecture": s.architecture, "parameters": s.parameters,
                            "n_ctx": s.n_ctx, "vocab": s.vocab} for s in self.shapes.values()],
                "rules": self.rules(), "notes": self.notes, "rows": rows,
                "targets": evaluate(rows, self.points, ints(self.args.prefill), ints(self.args.decode_after),
                                    ints(self.args.decode_batches)),
                "runs": self.runs, "seconds": time.perf_counter() - self.started}

    def save(self) -> None:
        path = self.json_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.result(complete=False), indent=1) + "\n")

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.log(f"  {text}")

    def rules(self) -> list[str]:
        ref = self.ref_prefill
        return [f"Rounds after the first leave out a llama.cpp batched-bench precision below {SLOW:.0%} of the best "
                "llama.cpp precision at every measure of round 1 (the notes name any).",
                f"Prefill beyond {ref:,} tokens runs on batched-bench only at the precision fastest at {ref:,} tokens "
                f"in round 1; llama.cpp's server runs that precision ({SERVER_FALLBACK} when round 1 measured none).",
                "attnserve with a named graph: `--allow-low-agreement` (random weights), prefix caching on, "
                f"`--max-running` ≥ {LEAST_RUNNING}, `--max-context` the longest sequence + {CONTEXT_MARGIN}; out of "
                "the box: `--bundle` alone (every other setting its default, the graph its own choice).",
                "llama.cpp: -t and -tb one per core, -fa on (measured faster for prefill on a 2-core avx512 machine: "
                "135.6 against 119.6 tok/s at 4,096 tokens), -ub 512 -b 2048; "
                "batched-bench's decode with -pps --kv-unified (the prompt held once); the server with --kv-unified "
                "and -c the most positions in flight (without it each of the 32 slots gets -c / 32), requests with "
                "cache_prompt true."]

    # ---- preparing --------------------------------------------------------------------------------------

    def prepare(self, names: list[str]) -> None:
        from bench.commands.bandwidth import read_bandwidth
        from bench.peers import attnserve_peer, llama_cpp

        for name in names:
            started = time.perf_counter()
            shape = prepare_shape(name, self.args.quick, self.args.work)
            self.shapes[shape.name] = shape
            self.plans[shape.name] = make_plan(self.args, shape.vocab)
            self.dropped[shape.name] = set()
            if self.plans[shape.name].longest() + CONTEXT_MARGIN > shape.n_ctx:
                raise ValueError(f"{shape.name} has {shape.n_ctx} positions; the plan needs "
                                 f"{self.plans[shape.name].longest() + CONTEXT_MARGIN}")
            self.log(f"{shape.name}: {shape.architecture}, {shape.parameters / 1e6:,.0f} M parameters; ready in "
                     f"{time.perf_counter() - started:.0f} s")
        self.versions = attnserve_peer.versions()
        if any(s.family.startswith("llama.cpp") for s in self.systems):
            why = llama_cpp.available()
            if why:
                self.note(f"llama.cpp skipped: {why}")
                self.systems = [s for s in self.systems if not s.family.startswith("llama.cpp")]
            else:
                self.llama_bin = llama_cpp.where()[0]
                self.versions |= llama_cpp.versions(self.llama_bin)
                self.convert_ggufs()
        if self.args.bandwidth_gbps:
            self.gb_per_s = self.args.bandwidth_gbps
        else:
            self.log("read bandwidth ...")
            self.gb_per_s = read_bandwidth(*((64, 1) if self.args.quick else ()))
            self.log(f"read bandwidth: {self.gb_per_s:.1f} GB/s")

    def convert_ggufs(self) -> None:
        from bench.peers import llama_cpp

        wanted = {s.variant for s in self.systems if s.family == "llama.cpp-batched"}
        if not wanted and any(s.family == "llama.cpp-server" for s in self.systems):
            wanted = {SERVER_FALLBACK}
        for shape in self.shapes.values():
            for precision in [p for p in PRECISIONS if p in wanted]:
                self.log(f"{shape.name}: llama.cpp's {precision} GGUF")
                gguf = llama_cpp.convert(shape.hf_dir, self.gguf_dir(shape), precision)
                if precision == "q4_0":  # quantized from f32, which no system runs: gigabytes of disk back
                    gguf.with_name(gguf.name.replace("-q4_0.", "-f32.")).unlink(missing_ok=True)

    def gguf_dir(self, shape: Shape) -> Path:
        return self.args.work / shape.name / "llama.cpp"

    # ---- the rounds -------------------------------------------------------------------------------------

    def run(self) -> None:
        for rnd in range(self.args.repeats):
            for shape in self.shapes.values():
                self.log(f"round {rnd + 1}/{self.args.repeats}, {shape.name}")
                for system in rotated(self.systems, rnd):
                    if system.key not in self.dropped[shape.name]:
                        self.run_system(system, shape, rnd)
                self.long_prefill(shape, rnd)
                if rnd == 0:
                    self.apply_slow_rule(shape)

    def run_system(self, system: System, shape: Shape, rnd: int) -> None:
        from bench.peers import llama_cpp

        self.log(f"    {system.label} ...")
        started = time.perf_counter()
        logs = self.args.work / shape.name / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        plan = self.plans[shape.name]
        label = system.label
        try:
            if system.family.startswith("attnserve"):
                from bench.real_runs import attnserve_run

                name = f"{system.key.replace(':', '-')}-round{rnd + 1}"
                run = attnserve_run(shape.bundle, self.attnserve_flags(system, shape, plan), plan, logs, name,
                                    self.log)
                run["weight_bytes_per_token"] = graph_weight_bytes_per_token(shape.bundle, run["graph"])
            elif system.family == "llama.cpp-batched":
                from bench.real_runs import batched_bench_run, gguf_bytes_per_token

                gguf = llama_cpp.convert(shape.hf_dir, self.gguf_dir(shape), system.variant)
                short = tuple(p for p in plan.prefill if p <= self.ref_prefill)
                run = batched_bench_run(self.llama_bin, gguf, plan, short, llama_cpp.cores(), logs, self.log)
                run["weight_bytes_per_token"] = gguf_bytes_per_token(gguf)
            else:
                from bench.real_runs import gguf_bytes_per_token, llama_server_run

                precision = self.server_precision(shape)
                label = f"{system.label} {precision}"
                gguf = llama_cpp.convert(shape.hf_dir, self.gguf_dir(shape), precision)
                run = llama_server_run(self.llama_bin, gguf, plan, llama_cpp.cores(), logs, self.log)
                run["weight_bytes_per_token"] = gguf_bytes_per_token(gguf)
        except Exception as e:  # a system that fails is reported and left out of later rounds
            why = failure(e)
            self.note(f"{shape.name}: {system.key} failed in round {rnd + 1} and was dropped: {why}")
            self.dropped[shape.name].add(system.key)
            return
        run |= {"shape": shape.name, "key": system.key, "family": system.family, "label": label,
                "round": rnd + 1, "seconds": time.perf_counter() - started}
        self.runs.append(run)
        for point in run.get("decode_apart", []):
            after, streams = point.split("x")
            self.note(f"{shape.name}: {label}, round {rnd + 1}: the {streams} streams after {after} tokens never all "
                      "decoded at once; that figure is the sum of each stream's own rate")
        if rnd == 0 and system.family == "llama.cpp-batched":
            self.first_round.setdefault(shape.name, {})[system.variant] = run
        self.log(f"    {label}: done in {run['seconds']:.0f} s")
        self.save()

    def attnserve_flags(self, system: System, shape: Shape, plan: Plan) -> list[str]:
        if system.family == "attnserve-default":
            return []
        running = max(LEAST_RUNNING, *plan.batches, len(plan.mixed))
        return ["--graph", system.variant, "--allow-low-agreement", "--prefix-caching", "--max-running", str(running),
                "--max-context", str(min(shape.n_ctx, plan.longest() + CONTEXT_MARGIN))]

    def server_precision(self, shape: Shape) -> str:
        return fastest_precision(self.first_round.get(shape.name, {}), self.ref_prefill) or SERVER_FALLBACK

    def long_prefill(self, shape: Shape, rnd: int) -> None:
        """Batched-bench's prefill beyond the target length, at the precision fastest at it in round 1."""
        from bench.peers import llama_cpp
        from bench.real_runs import batched_bench_run

        plan = self.plans[shape.name]
        long = tuple(p for p in plan.prefill if p > self.ref_prefill)
        precision = fastest_precision(self.first_round.get(shape.name, {}), self.ref_prefill)
        key = f"llama.cpp-batched:{precision}"
        run = next((r for r in self.runs if r["shape"] == shape.name and r["key"] == key and r["round"] == rnd + 1),
                   None)
        if not long or run is None:
            return
        self.log(f"    llama.cpp batched-bench {precision}, prefill beyond {self.ref_prefill:,} tokens ...")
        gguf = llama_cpp.convert(shape.hf_dir, self.gguf_dir(shape), precision)
        plan_long = Plan(long, (), plan.batches, plan.new_tokens, plan.mixed, plan.mixed_interval_s, plan.vocab,
                         plan.seed)
        logs = self.args.work / shape.name / "logs"
        try:
            extra = batched_bench_run(self.llama_bin, gguf, plan_long, long, llama_cpp.cores(), logs, self.log)
        except Exception as e:
            self.note(f"{shape.name}: {key} prefill beyond {self.ref_prefill:,} tokens failed in round {rnd + 1}: "
                      f"{failure(e)}")
            return
        run["prefill"] |= extra["prefill"]
        run["peak_rss_bytes"] = max(run["peak_rss_bytes"], extra["peak_rss_bytes"])
        run["settings"]["commands"] += " ; " + extra["settings"]["commands"]
        self.save()

    def apply_slow_rule(self, shape: Shape) -> None:
        if self.args.repeats < 2:
            return
        for precision, why in slow_precisions(self.first_round.get(shape.name, {})).items():
            self.dropped[shape.name].add(f"llama.cpp-batched:{precision}")
            self.note(f"{shape.name}: llama.cpp batched-bench {precision} left out after round 1: {why}")


def failure(e: Exception) -> str:
    """An error in one line: its first line and, when it goes on (a log's tail), its last."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return lines[0][:300] + (f" … {lines[-1][:300]}" if len(lines) > 1 else "")


def say(text: str) -> None:
    print(text, flush=True)  # a long run shows it is alive, also through a pipe


def parse_args(argv: list[str] | None):
    p = HintingParser(prog="attnserve bench compare --real-shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated real shapes (bench/real_shapes.py)")
    p.add_argument("--prefill", default="512,4000,16000", help="prompt tokens of each prefill point")
    p.add_argument("--decode-after", default="512,8000", help="prompt tokens before each decode point")
    p.add_argument("--decode-batches", default="1,8,32", help="concurrent streams of each decode point")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each decode stream generates")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the report shows their medians")
    p.add_argument("--graphs", default="static-int8,static-int4", help="attnserve's named graphs, one system each")
    p.add_argument("--systems", default="", help="only these (keys like llama.cpp-batched:q4_0, or families: "
                                                 "attnserve, attnserve-default, llama.cpp-batched, llama.cpp-server)")
    p.add_argument("--skip", default="", help="leave these out (keys or families)")
    p.add_argument("--mixed-requests", type=int, default=16)
    p.add_argument("--mixed-range", default="200,4000", help="the mixed load's prompt lengths: lo,hi (uniform)")
    p.add_argument("--mixed-new-tokens", type=int, default=64)
    p.add_argument("--mixed-interval", type=float, default=1.0, help="seconds between the mixed load's arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-gbps", type=float, help="read bandwidth (default: measured at the start)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "compare-real", help="GGUFs and logs, kept")
    p.add_argument("--quick", action="store_true", help="a tiny shape built in seconds, every code path: a minute")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where compare-real.json goes")
    p.add_argument("--no-write", action="store_true", help="leave docs/ alone (the JSON goes to --work)")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill, args.decode_after, args.decode_batches, args.new_tokens = "16,32", "16", "1,2", 4
        args.repeats, args.mixed_requests, args.mixed_range, args.mixed_interval = 1, 3, "8,48", 0.2
        args.mixed_new_tokens = 4
        if args.work == p.get_default("work"):
            args.work = Path(tempfile.mkdtemp(prefix="attnserve-compare-real-"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = select(all_systems([g for g in args.graphs.split(",") if g]), args.systems, args.skip)
    comparison = Comparison(args, argv, systems)
    comparison.prepare([QUICK_SHAPE] if args.quick else [s for s in args.shapes.split(",") if s])
    comparison.run()
    result = comparison.result(complete=True)
    md = render(result, argv)
    print(md, flush=True)
    if args.no_write:
        comparison.json_path().write_text(json.dumps(result, indent=1) + "\n")
    else:
        publish("compare-real", result, md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
