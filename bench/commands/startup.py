"""`attnserve bench startup`: how long `attnserve serve` takes to serve, on a first start and on a restart, and
what warming decode up buys.

    attnserve bench startup --bundle models/shakespeare-onnx
    attnserve bench startup --bundle runs/sizes/smollm2-135m/bundle --max-context 2048 --rounds 2 --name smollm2

- **start-up**: each round starts the server with an empty cache folder of its own (a first start: the graphs
  timed and the pick self-checked), stops it, and starts it again on that folder (a restart: the choice read
  from the cache). Each start is timed from the process's launch to `GET /health` 200, with the CPU time the
  server took to get there (a machine's other load stretches the wall time far more than that), and split
  into phases by its log's timestamps. Medians over the rounds, first starts and restarts interleaved.
- **warm-up** (`--warm-up`): in a child process per way of warming, the graph the server chose, bound to a KV
  cache of the server's shape (`--max-running` slots of `--max-context` positions): the warm-up's time, then at
  a few batch sizes the first decode's time and the next one's, which is what a request that widens the batch
  pays and what it would pay once warm. The ways: none; one decode at the widest batch (`Engine.warm_up`); one at
  every batch size from 1 to the widest (what `Engine.warm_up` did before). Medians over the rounds, the ways
  interleaved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from service.client.server_process import ServerProcess

# log lines that end each phase of a start, in order: (the phase, a phrase of the line that ends it)
PHASES = (("Python and imports", "loading the model"), ("graph chosen", "graph choice on"),
          ("engine built", "KV cache:"), ("warm-up", "warmed up"), ("rehearsal, ports", ": gRPC on"))
WARM_WAYS = ("none", "widest", "every")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def time_start(srv: ServerProcess, timeout_s: float = 1800.0) -> dict:
    """Launch `srv`, wait for `GET /health` 200, stop it; its time to serve, the CPU time it took (every thread's,
    user and system: what a busy machine's neighbours do not inflate as they do the wall time) and its phases."""
    launched = time.time()
    srv.launch()
    deadline = time.monotonic() + timeout_s
    while srv.http_health() != 200:
        if not srv.running or time.monotonic() > deadline:
            srv.kill()
            raise RuntimeError(f"the server did not serve; its log: {srv.logs[-1]}\n{srv.log()[-3000:]}")
        time.sleep(0.05)
    serving, cpu = time.time() - launched, cpu_seconds(srv.pid)
    srv.stop()
    return {"to_health_200_s": serving, "cpu_s": cpu, **phases(srv.log(), launched)}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far, every thread's, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phases(log: str, launched: float) -> dict:
    """Each phase's seconds, from the log's timestamps; the graph choice's own timing and checking."""
    out, previous = {}, launched
    for name, phrase in PHASES:
        line = next((line for line in log.splitlines() if phrase in line and STAMP.match(line)), None)
        if line is None:
            continue
        at = datetime.strptime(STAMP.match(line)[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out[name] = at - previous
        previous = at
    choice = next((line for line in log.splitlines() if "graph choice on" in line), "")
    if timed := re.search(r"timed in ([\d.]+) s, self-checked in ([\d.]+) s", choice):
        out["graphs timed"], out["graph self-checked"] = float(timed[1]), float(timed[2])
    served = re.search(r"serving (\S+) \(", choice)
    out["graph"] = served[1] if served else None
    out["cached"] = "not checked again" in choice
    return out


def start_up(args, rounds: int) -> dict:
    """First starts and restarts, `rounds` of each, interleaved."""
    runs: dict[str, list[dict]] = {"first start": [], "restart": []}
    for _ in range(rounds):
        cache = Path(tempfile.mkdtemp(prefix="attnserve-bench-cache-"))
        try:
            srv = ServerProcess(serve_args(args, cache), name="startup", stop_timeout_s=120)
            runs["first start"].append(time_start(srv))
            runs["restart"].append(time_start(srv))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return runs


def serve_args(args, cache: Path) -> list[str]:
    extra = ["--max-context", str(args.max_context)] if args.max_context else []
    return ["--bundle", str(args.bundle), "--max-running", str(args.max_running), "--cache-dir", str(cache),
            "--graph", args.graph, *extra]


def warm_up_costs(bundle: str, graph: str, rows: int, context: int | None, way: str, sizes: list[int]) -> dict:
    """In this process: `graph` on a fresh KV cache of `rows` slots, warmed `way`; then at each of `sizes`, the
    first decode's time and the next one's (ms)."""
    from dataclasses import replace

    from service.runtime.graph_choice import decode_ms
    from service.runtime.static_runner import StaticRunner

    runner = StaticRunner(bundle, graph, "cpu")
    runner.attach(replace(runner.cache_shape, max_seq=context or runner.cache_shape.max_seq).buffers(rows))
    started = time.perf_counter()
    for n in {"none": [], "widest": [rows], "every": range(1, rows + 1)}[way]:
        decode_ms(runner, n, 0)
    warm_up_s = time.perf_counter() - started
    first = {n: decode_ms(runner, n, 1) for n in sizes}
    after = {n: decode_ms(runner, n, 2) for n in sizes}
    return {"warm_up_s": warm_up_s, "first_ms": first, "next_ms": after}


def warm_ups(args, graph: str, rounds: int) -> dict:
    """`warm_up_costs` of every way, each in a child process, `rounds` times interleaved."""
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 24, 32, 48, args.max_running - 1, args.max_running)
                    if 1 <= n <= args.max_running})
    code = ("import json, sys; from bench.commands.startup import warm_up_costs; "
            "print(json.dumps(warm_up_costs(*json.loads(sys.argv[1]))))")
    runs: dict[str, list[dict]] = {way: [] for way in WARM_WAYS}
    for _ in range(rounds):
        for way in WARM_WAYS:
            spec = json.dumps([str(args.bundle), graph, args.max_running, args.max_context, way, sizes])
            out = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).resolve().parents[2])
            runs[way].append(json.loads(out.stdout.splitlines()[-1]))
    return {"sizes": sizes, "runs": runs}


def medians(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(result: dict) -> str:
    lines = [f"## Start-up: {result['name']}", "",
             f"`{shown(result['command'])}` on {machine_line(result['machine'])}; {result['rounds']} rounds, medians.",
             "", "Start to `GET /health` 200, the CPU time the server took to get there (every thread's, user and "
             "system), and its phases from the server's log (s):", "",
             "| start | to /health 200 | CPU time | " + " | ".join(name for name, _ in PHASES) + " | graph |",
             "|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for start, runs in result["start_up"].items():
        cells = [f"{medians(runs, name):.1f}" if medians(runs, name) is not None else "" for name, _ in PHASES]
        graph = runs[-1]["graph"] or "?"
        how = " (cached)" if runs[-1]["cached"] else f" (timed {medians(runs, 'graphs timed') or 0:.1f} s, " \
              f"self-checked {medians(runs, 'graph self-checked') or 0:.1f} s)"
        lines.append(f"| {start} | **{medians(runs, 'to_health_200_s'):.1f}** | {medians(runs, 'cpu_s'):.1f} | "
                     f"{' | '.join(cells)} | {graph}{how} |")
    warm = result.get("warm_up")
    if warm:
        ways = warm["runs"]
        lines += ["", f"Warm-up of `{warm['graph']}` on {result['max_running']} KV slots of "
                  f"{result['context']} positions: the warm-up's time, then a decode's first time at each batch "
                  "size and its next (ms):", "",
                  "| warm-up | seconds | " + " | ".join(f"batch {n}" for n in warm["sizes"]) + " |",
                  "|---|---|" + "---|" * len(warm["sizes"])]
        for way, runs in ways.items():
            cells = [f"{statistics.median(r['first_ms'][str(n)] for r in runs):.0f} / "
                     f"{statistics.median(r['next_ms'][str(n)] for r in runs):.0f}" for n in warm["sizes"]]
            lines.append(f"| {way} | {medians(runs, 'warm_up_s'):.1f} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=Path("models/shakespeare-onnx"))
    p.add_argument("--name", default=None, help="the section's name: startup-<name> (default: the bundle's folder)")
    p.add_argument("--graph", default="auto")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-context", type=int, default=None, help="positions per KV slot (default: the model's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm-up", action="store_true", help="also measure the ways of warming decode up")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    name = args.name or args.bundle.resolve().name
    from service.runtime.bundle import read_manifest

    context = args.max_context or read_manifest(args.bundle).model.n_ctx
    runs = start_up(args, args.rounds)
    result = {"machine": describe(), "name": name, "rounds": args.rounds, "max_running": args.max_running,
              "context": context, "command": " ".join(["attnserve bench startup", *(argv or sys.argv[1:])]),
              "start_up": runs}
    if args.warm_up:
        graph = runs["first start"][-1]["graph"] or "static"
        result["warm_up"] = {"graph": graph, **warm_ups(args, graph, args.rounds)}
    result = json.loads(json.dumps(result))  # as the JSON file holds it (batch sizes as strings)
    text = markdown(result)
    print(text)
    publish(f"startup-{name}", result, text, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
