"""The peer protocol of `attnserve bench compare`: one run spec in, one JSON-able result out.

Every system the comparison measures (a peer in its own virtualenv, or attnserve in a child process)
is one script that reads a spec and prints a result as the last line of its standard output. This
module is that contract in code, with the standard library only, so that a peer's interpreter can
import it (scripts in this folder run with the folder on sys.path) and so can `bench.commands.compare`.

Spec:   {"new_tokens": N, "single": [[ids], ...], "streams": [[ids] x 32], "repeats": R}
Result: {"system", "precision", "settings", "versions",
         "single": {"tokens_per_s": [..per repeat..], "ttft_s": [..]},
         "streams": {"n", "tokens_per_s": [..], "ttft_p50_s": [..], "ttft_p99_s": [..]},
         "tokens": [[N ids] x 32], "single_tokens": [[N ids] per single prompt], "peak_rss_bytes": int}

Batch 1 runs the `single` prompts one after another: tokens/s = their new tokens over their summed
times (prefill included), TTFT = the median over the prompts of send → first token. Streams: the 32
prompts at once, aggregate generated tokens/s over first send → last token, and TTFT percentiles over
the 32 sequences. `tokens` are the greedy ids of the `streams` prompts, `single_tokens` those of the
`single` prompts as batch 1 generated them alone (its first repeat): `bench.commands.compare` makes the `single`
prompts the first of the `streams`, so the two say whether a prompt's tokens depend on the batch it
ran in. A system without token ids (llama.cpp's batched-bench) gives None for both. Peak RSS is the
VmHWM of the process that holds the model.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

PRECISIONS = ("fp32", "f16", "int8", "int8-per-tensor", "q8_0", "q4_0", "int4")
STREAMS = 32


def read_spec(path: str | Path) -> dict:
    spec = json.loads(Path(path).read_text())
    missing = {"new_tokens", "single", "streams", "repeats"} - spec.keys()
    if missing:
        raise ValueError(f"the spec {path} lacks {sorted(missing)}")
    return spec


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics
    (numpy's default method); NaN for no values. `bench.stats` uses it too."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def peak_rss_bytes(pid: int | str = "self") -> int:
    """VmHWM of a process (Linux): the most resident memory it has held; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0  # an exited process not yet reaped keeps its status, without its memory


class Recorder:
    """Collects the timings of every repeat and assembles the result."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.single = {"tokens_per_s": [], "ttft_s": []}
        self.single_tokens: list[list[int]] | None = None  # the first repeat's batch-1 ids
        self.streams = {"n": len(spec["streams"]), "tokens_per_s": [], "ttft_p50_s": [], "ttft_p99_s": []}

    def add_single(self, seconds: list[float], ttfts: list[float], tokens: list[list[int]]) -> None:
        """One repeat of batch 1: each prompt's time (send → last token), TTFT and generated ids."""
        if self.single_tokens is None:
            self.single_tokens = tokens
        self.single["tokens_per_s"].append(self.spec["new_tokens"] * len(seconds) / sum(seconds))
        self.single["ttft_s"].append(statistics.median(ttfts) if ttfts else math.nan)

    def add_streams(self, seconds: float, ttfts: list[float]) -> None:
        """One repeat of the streams: first send → last token, and each stream's TTFT."""
        self.streams["tokens_per_s"].append(self.spec["new_tokens"] * self.streams["n"] / seconds)
        self.streams["ttft_p50_s"].append(percentile(ttfts, 50) if ttfts else math.nan)
        self.streams["ttft_p99_s"].append(percentile(ttfts, 99) if ttfts else math.nan)

    def result(self, system: str, precision: str, settings: dict, versions: dict, tokens: list[list[int]],
               peak_rss: int | None = None) -> dict:
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
        check_tokens(tokens, len(self.spec["streams"]), self.spec["new_tokens"], system)
        if self.single_tokens is None:
            raise RuntimeError(f"{system} ran no batch-1 repeat")
        check_tokens(self.single_tokens, len(self.spec["single"]), self.spec["new_tokens"], f"{system} (batch 1)")
        return {"system": system, "precision": precision, "settings": settings, "versions": versions,
                "single": self.single, "streams": self.streams, "tokens": tokens,
                "single_tokens": self.single_tokens,
                "peak_rss_bytes": peak_rss if peak_rss is not None else peak_rss_bytes()}


def check_tokens(tokens: list[list[int]], rows: int, new_tokens: int, system: str) -> None:
    if len(tokens) != rows or any(len(row) != new_tokens for row in tokens):
        raise RuntimeError(f"{system} returned {[len(row) for row in tokens]} tokens per row, "
                           f"expected {rows} rows of {new_tokens}")


def emit(result: dict) -> None:
    """The result as the last line of standard output (the caller reads only that line)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
