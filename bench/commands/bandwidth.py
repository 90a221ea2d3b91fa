"""`attnserve bench bandwidth`: how fast this machine reads memory, the bound on a batch-1 decode step.

    attnserve bench bandwidth                                  # 1 GB arrays, 7 rounds
    attnserve bench bandwidth --mb 64 --rounds 2 --out /tmp/x  # seconds

A batch-1 decode step reads every weight once, so (bytes of weights per token) / (read bandwidth) is the
fastest it can be. This probe reads arrays far larger than the caches with numpy, which releases the GIL
while it reduces:
- `read`, one thread: `sum` over the whole array;
- `read`, every core: the array split into one slice per core, summed on as many threads at once;
- `copy`: `copyto` between two such arrays, counted as the bytes read (a copy reads and writes each byte).
Each figure is the median over the rounds, in GB/s (10⁹ bytes a second). `read_bandwidth()` gives the
every-core figure to other benchmarks, which report their batch-1 speed as a share of that bound.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(mb: int = 1000, rounds: int = 7, threads: int | None = None) -> dict[str, float]:
    """GB/s of each probe: the median of `rounds`, on arrays of `mb` megabytes."""
    threads = threads or os.cpu_count() or 1
    n = mb * 1_000_000 // 4
    a = np.ones(n, dtype=np.float32)  # both written once, so every page is resident before timing
    b = np.empty_like(a)
    b.fill(0.0)
    slices = np.array_split(a, threads)
    times: dict[str, list[float]] = {"read_one_thread": [], "read_all_cores": [], "copy": []}
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):  # interleaved, so a slow moment of a shared machine falls on every probe
            times["read_one_thread"].append(_timed(a.sum))
            times["read_all_cores"].append(_timed(lambda: list(pool.map(np.sum, slices))))
            times["copy"].append(_timed(lambda: np.copyto(b, a)))
    return {name: a.nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


def read_bandwidth(mb: int = 1000, rounds: int = 5) -> float:
    """Read bandwidth with every core, GB/s: the bound a batch-1 decode step's weight reads meet."""
    return measure(mb, rounds)["read_all_cores"]


def markdown(result: dict) -> str:
    g = result["gb_per_s"]
    return "\n".join([
        "## Memory read bandwidth", "",
        f"`attnserve bench bandwidth --mb {result['mb']} --rounds {result['rounds']}` on "
        f"{machine_line(result['machine'])}.", "",
        f"numpy over {result['mb']} MB float32 arrays, the median of {result['rounds']} interleaved rounds "
        "(`bench/commands/bandwidth.py`). A batch-1 decode step reads every weight once: its tokens/s is at most this "
        "bandwidth over its bytes of weights.", "",
        "| probe | GB/s |", "|---|---|",
        f"| read, one thread (`sum`) | {g['read_one_thread']:.1f} |",
        f"| read, {result['threads']} threads (a slice each) | {g['read_all_cores']:.1f} |",
        f"| copy (`copyto`, bytes read) | {g['copy']:.1f} |",
    ])


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=1000, help="size of each array, in MB (far above the caches)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each figure is their median")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where bandwidth.json goes (docs/bench: and "
                                                                   "its section of BENCHMARKS.md)")
    args = p.parse_args(argv)
    threads = os.cpu_count() or 1
    result = {"machine": describe(), "mb": args.mb, "rounds": args.rounds, "threads": threads,
              "gb_per_s": measure(args.mb, args.rounds, threads)}
    text = markdown(result)
    print(text)
    publish("bandwidth", result, text, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
