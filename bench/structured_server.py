"""`attnserve bench structured --part server`: constrained against unconstrained generation on the shipped
model, in the engine, over attnserve's HTTP front and in llama.cpp's server, in one interleaved run.

    result = server_part(bundle, hf_dir, work)      # the `server` entry of docs/bench/structured.json
    lines = server_markdown(result)

- Requests: `streams` random prompts of `prompt_tokens` ids (`bench.workload.fixed`), a seed each,
  temperature 1 (`bench.structured_load`). Batch 1 is the first `singles` of them one after another;
  the streams are all of them at once.
- Constrained: SERVER_SCHEMA of `bench.structured_cases`, at most `budget` tokens. Unconstrained: the same
  prompts and seeds, each asking for exactly as many tokens as the same system's constrained warm-up run
  of that prompt generated (`ignore_eos`, min = max tokens), so both modes generate the same counts per
  request, and a batch's tail (its longest completions) is the same in both.
- A round runs every system (their order rotated each round) at both levels in both modes (constrained
  first in even rounds, unconstrained first in odd ones). tokens/s = generated tokens / wall time; the
  table has medians over rounds. Every constrained completion is checked with `jsonschema`.
- Masks: `MaskClock` around the in-process constrained runs. Compile: `Grammars.compile` of a schema the
  engine has not seen (SERVER_SCHEMA with another `maximum` for `id`) and of the same again (the cache),
  each with its first mask; over HTTP, a 1-token constrained request with a new schema, then the same again.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import time
from pathlib import Path

from bench import workload
from bench.commands.compare import rotated
from bench.peers.attnserve_peer import limits, serve_args
from bench.structured_cases import SERVER_SCHEMA, matches
from bench.structured_load import AttnserveHttp, EngineDriver, LlamaCppHttp, MaskClock, StepClock

GRAPH = "static"  # fp32, as llama.cpp's f32 GGUF
PRECISION = "f32"
TARGET = 0.9  # constrained / unconstrained tokens/s at the streams level, every stream constrained
MODES = ("constrained", "unconstrained")


def variant(k: int) -> dict:
    """SERVER_SCHEMA with `id` bounded by its maximum + 1 + k: a schema no cache has seen, of the same size."""
    schema = copy.deepcopy(SERVER_SCHEMA)
    schema["properties"]["id"]["maximum"] += 1 + k
    return schema


def start_llama(stack: contextlib.ExitStack, hf_dir: Path | None, work: Path, spec: dict, notes: list[str],
                log) -> tuple[LlamaCppHttp | None, dict]:
    """llama-server on the shipped model's f32 GGUF, or None and a note saying why not."""
    from bench.peers import llama_cpp

    why = llama_cpp.available() or (None if hf_dir is not None else "no Hugging Face directory of the model given")
    if why:
        notes.append(f"llama.cpp skipped: {why}")
        log(f"llama.cpp skipped: {why}")
        return None, {}
    gguf = llama_cpp.convert(hf_dir, work, PRECISION)
    bin_dir, _ = llama_cpp.where()
    context = llama_cpp.context_per_sequence(spec) * llama_cpp.SLOTS
    server = stack.enter_context(llama_cpp.LlamaServer(bin_dir, gguf, context, llama_cpp.cores(),
                                                       work / "structured-llama-server.log"))
    driver = LlamaCppHttp(server.url)
    settings = {"gguf": gguf.name, "command": " ".join(Path(a).name if a.startswith("/") else a for a in server.args),
                "request": driver.body(["ids"], 0, spec["new_tokens"], {"...": "the schema"}),
                **llama_cpp.versions(bin_dir)}
    return driver, settings


def check(counts: dict, done) -> None:
    """Add constrained completions to `counts`: total, finished (not cut by the token limit), valid."""
    for c in done:
        counts["total"] += 1
        counts["finished"] += c.finished
        counts["valid"] += matches(c.text, SERVER_SCHEMA)


def engine_compile(grammars, k: int) -> dict:
    """One cold and one cached `Grammars.compile` of variant(k), each with its first mask (µs)."""
    from service.engine.request import Constraint

    constraint = Constraint("json_schema", json.dumps(variant(k)))
    out = {}
    for kind in ("cold", "cached"):
        start = time.perf_counter()
        grammar = grammars.compile(constraint)
        out[kind] = (time.perf_counter() - start) * 1e6
        start = time.perf_counter()
        grammars.masks([grammar.matcher()])
        out[f"{kind}_first_mask"] = (time.perf_counter() - start) * 1e6
    return out


def http_compile(driver, prompt: list[int], seed: int, k: int) -> dict:
    """A 1-token constrained request (ms) with variant(k), new to the server, then the same again."""
    return {kind: driver.run([prompt], [seed], [1], variant(k), concurrent=False)[1] * 1e3
            for kind in ("new", "repeat")}


def server_part(bundle: Path, hf_dir: Path | None = None, work: Path | None = None, streams: int = 32,
                singles: int = 3, prompt_tokens: int = 16, budget: int = 240, rounds: int = 11, seed: int = 0,
                http: bool = True, llama: bool = True, log=print) -> dict:
    """The `server` entry of the result (see the module docstring)."""
    load = [os.getloadavg()]
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        prompts, seeds, lim, engine = _engine(bundle, streams, singles, prompt_tokens, budget, seed)
        spec = {"new_tokens": budget, "single": prompts[:singles], "streams": prompts}
        drivers = [EngineDriver(engine)]
        settings = {"engine": {"graph": engine.runner.graph_name, "prefix_caching": False, **lim,
                               "api": "Engine.generate, the prompts at once (streams) or one by one (batch 1)"}}
        if http:
            from service.client.server_process import ServerProcess

            args = serve_args(bundle, GRAPH, lim)
            drivers.append(AttnserveHttp(stack.enter_context(ServerProcess(args)).http_url))
            settings["http"] = {"server": "attnserve serve " + " ".join(args),
                                "request": drivers[-1].body(["ids"], 0, budget, {"...": "the schema"})}
        if llama:
            driver, settings["llama.cpp"] = start_llama(stack, hf_dir, work or Path("runs"), spec, notes, log)
            drivers += [driver] if driver else []
        levels = {1: (prompts[:singles], seeds[:singles], False), streams: (prompts, seeds, True)}
        result = _rounds(drivers, levels, engine, budget, rounds, (prompts[0], seeds[0]), notes, log)
        settings["retried"] = {d.name: d.retried for d in drivers if hasattr(d, "retried")}
    load.append(os.getloadavg())
    return {"model": str(bundle), "graph": settings["engine"]["graph"], "llama_cpp_precision": PRECISION,
            "streams": streams, "singles": singles, "prompt_tokens": prompt_tokens, "budget": budget,
            "rounds": rounds, "seed": seed, "schema": SERVER_SCHEMA, "target": TARGET, "settings": settings,
            "load_average": {"start": load[0], "end": load[1]}, "notes": notes, **result}


def _engine(bundle: Path, streams: int, singles: int, prompt_tokens: int, budget: int, seed: int):
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from service.runtime.bundle import read_manifest

    vocab = read_manifest(bundle).model.vocab_size
    prompts = [item.prompt for item in workload.fixed(streams, prompt_tokens, budget, vocab, seed)]
    seeds = [seed * 1000 + i for i in range(streams)]
    lim = limits({"streams": prompts, "single": prompts[:singles], "new_tokens": budget})
    engine = Engine(EngineConfig(bundle=bundle, graph=GRAPH, prefix_caching=False, **lim))
    engine.warm_up()
    return prompts, seeds, lim, engine


def _rounds(drivers, levels: dict, engine, budget: int, rounds: int, probe: tuple[list[int], int], notes: list[str],
            log) -> dict:
    """The warm-up (constrained: each request's token count), then the rounds; summarized."""
    validity = {d.name: {"total": 0, "finished": 0, "valid": 0} for d in drivers}
    counts: dict[tuple[str, int], list[int]] = {}
    for d in drivers:
        for level, (ps, ss, together) in levels.items():
            done, _ = d.run(ps, ss, [budget] * len(ps), SERVER_SCHEMA, together)
            check(validity[d.name], done)
            counts[d.name, level] = [c.tokens for c in done]
            d.run(ps, ss, counts[d.name, level], None, together)
    runs = {d.name: {level: {mode: [] for mode in MODES} for level in levels} for d in drivers}
    clocks = {level: MaskClock(engine.grammars) for level in levels}
    steps = {(level, mode): StepClock(engine) for level in levels for mode in MODES}
    compiles: dict[str, list[dict]] = {d.name: [] for d in drivers}
    load = []  # the load average after each round: a round another process disturbed shows here
    for r in range(rounds):
        for d in rotated(drivers, r):
            inproc = isinstance(d, EngineDriver)
            for level, (ps, ss, together) in levels.items():
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    limit = [budget] * len(ps) if mode == "constrained" else counts[d.name, level]
                    schema = SERVER_SCHEMA if mode == "constrained" else None
                    with contextlib.ExitStack() as timed:
                        if inproc:  # the clocks time the in-process engine only
                            timed.enter_context(steps[level, mode])
                            timed.enter_context(clocks[level] if schema else contextlib.nullcontext())
                        done, seconds = d.run(ps, ss, limit, schema, together)
                    if inproc:
                        steps[level, mode].add(done, seconds)
                    if schema:
                        check(validity[d.name], done)
                    elif [c.tokens for c in done] != limit:
                        notes.append(f"{d.name}: unconstrained requests at {level} streams did not generate "
                                     "exactly the tokens asked for")
                    runs[d.name][level][mode].append({"tokens": sum(c.tokens for c in done), "requests": len(done),
                                                      "seconds": seconds})
            k = r * len(drivers) + drivers.index(d)
            compiles[d.name].append(engine_compile(engine.grammars, k) if inproc else http_compile(d, *probe, k))
        load.append(os.getloadavg())
        log(f"round {r + 1}/{rounds}: " + "; ".join(
            f"{name} {level}: {_tps(modes['constrained'][-1]):.0f} / {_tps(modes['unconstrained'][-1]):.0f} tok/s"
            for name, by_level in runs.items() for level, modes in by_level.items()))
    return {"rows": _rows(runs, counts), "validity": validity,
            "masks": {str(level): c.summary() for level, c in clocks.items()},
            "steps": {f"{level} {mode}": c.summary() for (level, mode), c in steps.items()},
            "compile": {name: {key: statistics.median(c[key] for c in cs) for key in cs[0]} for name, cs in
                        compiles.items()}, "compile_samples": compiles, "load_per_round": load}


def _tps(sample: dict) -> float:
    return sample["tokens"] / sample["seconds"]


def _rows(runs: dict, counts: dict) -> list[dict]:
    rows = []
    for name, by_level in runs.items():
        for level, modes in by_level.items():
            per_round = {mode: [_tps(s) for s in samples] for mode, samples in modes.items()}
            median = {mode: statistics.median(v) for mode, v in per_round.items()}
            rows.append({"system": name, "streams": level, "constrained_tokens_per_s": median["constrained"],
                         "unconstrained_tokens_per_s": median["unconstrained"],
                         "ratio": median["constrained"] / median["unconstrained"],
                         "constrained_completions_per_s": statistics.median(
                             s["requests"] / s["seconds"] for s in modes["constrained"]),
                         "ratio_per_round": [a / b for a, b in zip(*per_round.values(), strict=True)],
                         "tokens_per_request": statistics.mean(counts[name, level]),
                         "unconstrained_tokens": counts[name, level], "samples": modes})
    return rows


def server_markdown(s: dict, command: str, machine: str) -> list[str]:
    """The server part's lines of the structured section of BENCHMARKS.md."""
    llama = s["settings"].get("llama.cpp") or {}
    size = s.get("size", "shipped")
    model = "The shipped model" if size == "shipped" else f"The {size} shape with random weights (`bench/sizes.py`)"
    lines = ["### Constrained against unconstrained generation, in the engine, over HTTP and in llama.cpp"
             + ("" if size == "shipped" else f": {size}"), "",
             f"`{command}` on {machine}; load average (1, 5, 15 min) {_load(s['load_average']['start'])} at the "
             f"start, {_load(s['load_average']['end'])} at the end.", "",
             f"{model}: attnserve's `{s['graph']}` graph (fp32)"
             + (f", llama.cpp's `{llama['gguf']}` (its converter, f32; llama.cpp {llama['llama.cpp']})" if llama
                else "") + f". {s['prompt_tokens']}-token random prompt ids, the `SERVER_SCHEMA` of "
             "`bench/structured_cases.py` (8 bounded fields), temperature 1, a seed per prompt, nothing else in "
             f"the sampler. Constrained: at most {s['budget']} tokens. Unconstrained: the same prompts and seeds, "
             "each request asking for exactly the tokens that the same system's constrained warm-up of it "
             "generated (`ignore_eos`, min = max tokens), so the two modes generate the same counts per request. "
             f"Batch 1: {s['singles']} prompts one after another; {s['streams']} streams: all at once, every one "
             f"constrained. tokens/s = generated tokens / wall time, medians over {s['rounds']} interleaved rounds "
             "(systems rotated, modes alternated). Requests are not streamed.", "",
             "| system | streams | constrained tokens/s | unconstrained tokens/s | constrained ÷ unconstrained "
             "| tokens per completion | constrained completions/s | valid / constrained completions |",
             "|---|---|---|---|---|---|---|---|"]
    for row in s["rows"]:
        v = s["validity"][row["system"]]
        lines.append(f"| {row['system']} | {row['streams']} | {row['constrained_tokens_per_s']:.0f} | "
                     f"{row['unconstrained_tokens_per_s']:.0f} | {row['ratio']:.2f}× | "
                     f"{row['tokens_per_request']:.0f} | {row['constrained_completions_per_s']:.1f} | "
                     f"{v['valid']}/{v['total']} ({v['total'] - v['finished']} "
                     "cut by the token limit) |")
    lines += ["", *_target_lines(s), "", *_step_lines(s), "", *_mask_lines(s), "", *_compile_lines(s)]
    if s["notes"]:
        lines += ["", *(f"- {n}" for n in s["notes"])]
    return lines


def _load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _target_lines(s: dict) -> list[str]:
    out = []
    for row in s["rows"]:
        if row["streams"] == s["streams"] and row["system"].startswith("attnserve"):
            met = "met" if row["ratio"] >= s["target"] else "missed"
            out.append(f"- Target: constrained ≥ {s['target']}× unconstrained at {s['streams']} streams, "
                       f"{row['system']}: {row['ratio']:.2f}×, **{met}** (per round: "
                       f"{', '.join(f'{r:.2f}' for r in row['ratio_per_round'])}).")
    return out


def _table(intro: str, header: list[str], rows: list[str]) -> list[str]:
    return [intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]


def _step_lines(s: dict) -> list[str]:
    rows = []
    for key, c in s.get("steps", {}).items():
        u = c["us_per_token"]
        cells = [c["wall_us_per_token"], *(u[k] for k in ("run_decode", "run_prefill", "masks_of", "sample", "update")),
                 c["rest_us_per_token"]]
        rows.append(f"| {' | '.join(key.split(' '))} | " + " | ".join(f"{v:.0f}" for v in cells) + " |")
    return _table("Where a generated token's time goes in the engine (in-process, every round; µs per generated "
                  "token; `bench.structured_load.StepClock` wraps the engine's parts in the benchmark's process, in "
                  "both modes): the model's decode and prefill calls, the constrained rows' masks (computed, and "
                  "unpacked for the sampler), the sampler, the output step (where each matcher consumes its token), "
                  "and the rest of the loop.",
                  ["streams", "mode", "all", "decode", "prefill", "masks", "sample", "output step", "rest"], rows)


def _mask_lines(s: dict) -> list[str]:
    def mm(d: dict | None) -> str:
        return f"{d['median']:.0f} ({d['mean']:.0f})" if d else "—"

    rows = [f"| {level} | {m['mask_us_per_token']:.1f} | {m['rows_per_call']:.0f} | {mm(m['call_us'])} |"
            for level, m in s["masks"].items()]
    return _table("Masks inside the engine, over the in-process constrained runs of every round (`bench."
                  "structured_load.MaskClock` wraps `Grammars.masks`, which computes a step's constrained rows on the "
                  "engine thread, one after another). µs as median (mean).",
                  ["streams", "mask µs per token", "rows per step", "µs per step"], rows)


def _compile_lines(s: dict) -> list[str]:
    c = s["compile"]
    lines = ["Compile, medians over rounds (one schema new to the system per round):", "",
             "| where | new schema | cached (the same again) |", "|---|---|---|"]
    e = c.get("attnserve in-process")
    if e:
        lines += [f"| engine, `Grammars.compile` | {e['cold'] / 1e3:.2f} ms | {e['cached']:.1f} µs |",
                  f"| engine, its first mask | {e['cold_first_mask']:.0f} µs | {e['cached_first_mask']:.0f} µs |"]
    for name in ("attnserve HTTP", "llama.cpp server"):
        if name in c:
            lines.append(f"| {name}, a 1-token constrained request | {c[name]['new']:.1f} ms | "
                         f"{c[name]['repeat']:.1f} ms |")
    return lines
