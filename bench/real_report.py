"""The arithmetic and the report of `attnserve bench compare --real-shapes` (bench/commands/compare_real.py):
no processes, no clocks, so that every rule here is tested on made-up numbers.

- `decode_rate`: tokens/s of B streams decoding together, from each stream's token arrivals.
- `mixed_summary`: TTFT p50/p99 and the wall time of the staggered mixed load.
- `summarize`: one row per (shape, system) from the rounds' runs: medians over rounds, the largest peak RSS.
- `slow_precisions`, `fastest_precision`: the rules that keep a run short (llama.cpp precisions left out of
  later rounds, the one precision that runs the longest prefill).
- `evaluate`: the targets, attnserve against llama.cpp's best, met or missed.
- `render`: the markdown section of docs/BENCHMARKS.md.

A run (one system, one shape, one round) is a dict: `prefill` {P: tok/s}, `prefill_server` {P: tok/s} (attnserve's
own account, from its metrics), `decode` {P: {B: tok/s}}, `decode_apart` ["PxB" whose streams never all decoded
at once], `mixed` {ttft_p50_s, ttft_p99_s, total_s, requests},
`peak_rss_bytes`, `weight_bytes_per_token`, `graph`, `settings`. Keys P and B are strings, as JSON keeps them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.machine import machine_line, shown
from bench.stats import percentile

SLOW = 0.8  # a llama.cpp precision below this share of the best one at every measure of round 1 is left out later
FAMILIES = {  # family -> how the report names it
    "attnserve": "attnserve gRPC", "attnserve-default": "attnserve out of the box",
    "llama.cpp-batched": "llama.cpp batched-bench", "llama.cpp-server": "llama.cpp server"}
OURS = ("attnserve", "attnserve-default")
PEERS = ("llama.cpp-batched", "llama.cpp-server")


@dataclass(frozen=True)
class Points:
    """Where the targets are read: the prefill length, the prompt before decoding, the streams of the second
    decode target (batch 1 is the first)."""

    prefill: int  # prompt tokens of the prefill target
    after: int  # prompt tokens before the decode targets
    streams: int  # concurrent streams of the second decode target


REAL_POINTS = Points(prefill=4000, after=512, streams=8)
QUICK_POINTS = Points(prefill=16, after=16, streams=2)
TARGETS = (  # (what, least ratio); read at `Points`
    ("prefill", 1.2), ("decode-1", 1.5), ("decode-streams", 2.0))


# ---- rates ----------------------------------------------------------------------------------------------


def decode_rate(streams: Sequence[Sequence[tuple[float, int]]]) -> float:
    """Tokens/s of streams decoding together, from each stream's (arrival time, tokens) of its messages that
    carry tokens: the tokens that arrived inside the window in which every stream was decoding (from the
    latest first token to the earliest last token), over its length. Without such a window (one stream, or
    streams that never overlapped after their first tokens) each stream's own rate after its first message,
    summed; one stream's window is itself, so both give (N − 1) / (t_last − t_first) for it."""
    streams = [s for s in streams if s]
    if not streams:
        return math.nan
    if all_decoding(streams):
        start, end = max(s[0][0] for s in streams), min(s[-1][0] for s in streams)
        return sum(n for s in streams for t, n in s if start < t <= end) / (end - start)
    rates = [sum(n for _, n in s[1:]) / (s[-1][0] - s[0][0]) for s in streams if s[-1][0] > s[0][0]]
    return sum(rates) if rates else math.nan


def all_decoding(streams: Sequence[Sequence[tuple[float, int]]]) -> bool:
    """Whether the streams (two or more) had a moment in which every one of them was decoding: False when a
    server could not hold them all at once and ran some after others (then `decode_rate` sums their own rates)."""
    streams = [s for s in streams if s]
    return len(streams) > 1 and min(s[-1][0] for s in streams) > max(s[0][0] for s in streams)


def mixed_summary(sent: Sequence[float], first: Sequence[float | None], ends: Sequence[float]) -> dict:
    """The mixed load from each request's send time, first-token time and last-token time."""
    ttfts = [f - s for s, f in zip(sent, first, strict=True) if f is not None]
    return {"requests": len(sent), "answered": len(ttfts),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else math.nan,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else math.nan,
            "total_s": max(ends) - min(sent) if sent else math.nan}


# ---- over rounds ----------------------------------------------------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def _medians(dicts: list[dict]) -> dict:
    """Key by key (nested dicts too), the median over `dicts` of the values they have."""
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    out = {}
    for k in keys:
        values = [d[k] for d in dicts if k in d]
        out[k] = _medians(values) if all(isinstance(v, dict) for v in values) else _median(values)
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (shape, system) in the order first run: medians over its rounds."""
    rows = []
    for shape, key in dict.fromkeys((r["shape"], r["key"]) for r in runs):
        mine = [r for r in runs if r["shape"] == shape and r["key"] == key]
        first = mine[0]
        rows.append({"shape": shape, "key": key, "family": first["family"], "label": first["label"],
                     "rounds": len(mine), "prefill": _medians([r.get("prefill", {}) for r in mine]),
                     "prefill_server": _medians([r.get("prefill_server", {}) for r in mine]),
                     "decode": _medians([r.get("decode", {}) for r in mine]),
                     "decode_apart": sorted({p for r in mine for p in r.get("decode_apart", [])}),
                     "mixed": _medians([r["mixed"] for r in mine if r.get("mixed")]),
                     "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0 for r in mine), default=0) or None,
                     "weight_bytes_per_token": first.get("weight_bytes_per_token"),
                     "graph": ", ".join(dict.fromkeys(r["graph"] for r in mine if r.get("graph"))) or None,
                     "settings": first.get("settings", {})})
    return rows


def measures(run: dict) -> dict[str, float]:
    """A run's figures, flat: prefill@P and decode@P×B."""
    flat = {f"prefill@{p}": v for p, v in run.get("prefill", {}).items()}
    flat |= {f"decode@{p}x{b}": v for p, by_b in run.get("decode", {}).items() for b, v in by_b.items()}
    return {k: v for k, v in flat.items() if v is not None and not math.isnan(v)}


def slow_precisions(first_round: dict[str, dict]) -> dict[str, str]:
    """Of llama.cpp's precisions (precision -> its round-1 run), those below SLOW × the best precision at
    every measure they have: precision -> why, for the notes."""
    flat = {p: measures(run) for p, run in first_round.items()}
    slow = {}
    for p, figures in flat.items():
        shares = [v / max(other[k] for other in flat.values() if k in other) for k, v in figures.items()]
        if shares and all(s < SLOW for s in shares):
            slow[p] = (f"below {SLOW:.0%} of the best llama.cpp precision at every measure of round 1 "
                       f"(at most {max(shares):.0%})")
    return slow


def fastest_precision(first_round: dict[str, dict], prefill: int) -> str | None:
    """The precision whose round-1 prefill at `prefill` tokens was fastest; None when none measured it."""
    rates = {p: run.get("prefill", {}).get(str(prefill)) for p, run in first_round.items()}
    rates = {p: v for p, v in rates.items() if v is not None and not math.isnan(v)}
    return max(rates, key=rates.get) if rates else None


def nearest(points: Sequence[int], want: int) -> int | None:
    """`want` if measured, else the largest point below it, else the smallest."""
    points = sorted(points)
    if not points:
        return None
    below = [p for p in points if p <= want]
    return below[-1] if below else points[0]


# ---- targets ------------------------------------------------------------------------------------------------


def target_value(row: dict, what: str, prefill: int, after: int, streams: int) -> float | None:
    if what == "prefill":
        return row["prefill"].get(str(prefill))
    batch = 1 if what == "decode-1" else streams
    return row["decode"].get(str(after), {}).get(str(batch))


def _best(rows: list[dict], value) -> tuple[dict | None, float | None]:
    measured = [(r, value(r)) for r in rows if value(r) is not None]
    return max(measured, key=lambda rv: rv[1]) if measured else (None, None)


def evaluate(rows: list[dict], want: Points, prefill: Sequence[int], after: Sequence[int],
             batches: Sequence[int]) -> list[dict]:
    """Per shape and target: attnserve's best named graph, and attnserve out of the box, against llama.cpp's
    best (any precision, batched-bench or server); `met` None when a side was not measured. The points are
    `want`'s, or the nearest measured."""
    p, a, b = nearest(prefill, want.prefill), nearest(after, want.after), nearest(batches, want.streams)
    texts = {"prefill": f"prefill at {p} tokens", "decode-1": f"decode, batch 1, after {a}",
             "decode-streams": f"decode, {b} streams, after {a}"}
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        here = [r for r in rows if r["shape"] == shape]
        for what, least in TARGETS:
            if what == "decode-streams" and b == 1:
                continue  # no decode with several streams was measured: batch 1's target says it all

            def value(r, what=what):
                return target_value(r, what, p, a, b)

            peer, peer_value = _best([r for r in here if r["family"] in PEERS], value)
            for family in OURS:
                ours, ours_value = _best([r for r in here if r["family"] == family], value)
                if ours is None and peer is None:
                    continue
                ratio = ours_value / peer_value if ours_value is not None and peer_value else math.nan
                out.append({"shape": shape, "target": f"{texts[what]} ≥ {least}×", "least": least,
                            "ours": ours["label"] if ours else FAMILIES[family], "ours_value": ours_value,
                            "peer": peer["label"] if peer else None, "peer_value": peer_value, "ratio": ratio,
                            "met": None if math.isnan(ratio) else bool(ratio >= least)})
    return out


# ---- the report -------------------------------------------------------------------------------------------


def _num(v, scale: float = 1.0, fmt: str = ".0f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v * scale, fmt)


def prefill_table(rows: list[dict], lengths: Sequence[int]) -> list[str]:
    lines = ["| system | " + " | ".join(f"{p:,} tokens" for p in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for r in rows:
        cells = []
        for p in lengths:
            cell = _num(r["prefill"].get(str(p)))
            server = r["prefill_server"].get(str(p))
            cells.append(cell + (f" ({_num(server)})" if server is not None else ""))
        lines.append(f"| {_name(r)} | " + " | ".join(cells) + " |")
    return lines


def decode_table(rows: list[dict], after: Sequence[int], batches: Sequence[int]) -> list[str]:
    columns = [(a, b) for a in after for b in batches]
    lines = ["| system | " + " | ".join(f"after {a:,}, {b} stream{'s' if b > 1 else ''}" for a, b in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for r in rows:
        apart = set(r.get("decode_apart", []))
        lines.append(f"| {_name(r)} | " + " | ".join(_num(r["decode"].get(str(a), {}).get(str(b)), 1, ".1f")
                                                     + ("*" if f"{a}x{b}" in apart else "") for a, b in columns)
                     + " |")
    if any(r.get("decode_apart") for r in rows):
        lines += ["", "\\* in some round the streams never all decoded at once (the server held fewer): the sum of "
                  "each stream's own rate."]
    return lines


def system_table(rows: list[dict], after: int | None, gb_per_s: float | None) -> list[str]:
    """Mixed-load TTFT, peak RSS, and batch 1 after `after` against the read bandwidth."""
    lines = ["| system | mixed TTFT p50 ms | mixed TTFT p99 ms | mixed total s | peak RSS MB | weights read / "
             "token MB | batch 1 tok/s | GB/s read | of bandwidth |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rate = r["decode"].get(str(after), {}).get("1")
        weights = r.get("weight_bytes_per_token")
        reached = weights * rate / 1e9 if weights and rate else None
        share = f"{reached / gb_per_s:.0%}" if reached and gb_per_s else "—"
        mixed = r["mixed"] or {}
        lines.append(f"| {_name(r)} | {_num(mixed.get('ttft_p50_s'), 1e3)} | {_num(mixed.get('ttft_p99_s'), 1e3)} | "
                     f"{_num(mixed.get('total_s'), 1, '.1f')} | {_num(r['peak_rss_bytes'], 1e-6)} | "
                     f"{_num(weights, 1e-6, '.1f')} | {_num(rate, 1, '.1f')} | {_num(reached, 1, '.1f')} | {share} |")
    return lines


def target_lines(targets: list[dict]) -> list[str]:
    lines = ["| shape | target | attnserve | tok/s | llama.cpp's best | tok/s | ratio | |",
             "|---|---|---|---:|---|---:|---:|---|"]
    for t in targets:
        verdict = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
        ratio = "" if t["ratio"] is None or math.isnan(t["ratio"]) else f"{t['ratio']:.2f}×"
        lines.append(f"| {t['shape']} | {t['target']} | {t['ours']} | {_num(t['ours_value'], 1, '.1f')} | "
                     f"{t['peer'] or 'not measured'} | {_num(t['peer_value'], 1, '.1f')} | {ratio} | {verdict} |")
    return lines


def _name(row: dict) -> str:
    return f"**{row['label']}**" if row["family"] in OURS else row["label"]


def settings_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        settings = "; ".join(f"{k}: {shown(str(v))}" for k, v in r["settings"].items() if v is not None)
        graph = f" (served {r['graph']})" if r["family"] == "attnserve-default" and r["graph"] else ""
        lines.append(f"- {r['shape']}, {r['label']}{graph}: {settings}")
    return lines


def how_measured(result: dict) -> str:
    plan = result["plan"]
    mixed = plan["mixed"]
    return ("Random weights at the shapes people serve (bench/real_shapes.py), the same Hugging Face checkpoint "
            "for both: attnserve's bundle, llama.cpp's GGUFs from its own converter. Medians of "
            f"{result['repeats']} rounds; each round runs every system once per shape, in an order rotated by one "
            "per round, each system in a process of its own. **Prefill**: one request of P random ids, 1 new "
            "token; P / TTFT (send to first token, client side; in parentheses attnserve's own figure from its "
            "TTFT histogram); batched-bench: its S_PP. **Decode**: B streams with the same prompt of P ids "
            f"(sent once before, so a prefix cache holds it), {plan['new_tokens']} greedy tokens each; tokens "
            "received while all B decode, over that window (arrivals are the stream's messages, at the server's "
            "default stream settings); batched-bench: its S_TG with the prompt shared "
            f"(-pps). **Mixed load**: {mixed['requests']} distinct prompts of {mixed['lo']:,}–{mixed['hi']:,} "
            f"tokens (seeded), {mixed['new_tokens']} new tokens each, one every {mixed['interval_s']} s. "
            "**Bandwidth**: bytes of weights read per token (attnserve: its graph's initializers, "
            "bench/roofline.py; llama.cpp: the GGUF's tensors, the embedding counted when the head is tied to it) "
            "× batch-1 decode tokens/s after "
            f"{result['bandwidth_after']:,}, against the read bandwidth.")


def render(result: dict, argv: Sequence[str] | None) -> str:
    cmd = shown("attnserve bench compare --real-shapes" + (" " + " ".join(argv) if argv else ""))
    plan = result["plan"]
    versions = "".join(f" {k} {v}." for k, v in result.get("versions", {}).items())
    lines = ["## attnserve against llama.cpp at real shapes", "",
             f"`{cmd}` on {machine_line(result['machine'])}; read bandwidth "
             f"{_num(result['read_gb_per_s'], 1, '.1f')} GB/s (every core).{versions}", "",
             how_measured(result), ""]
    for info in result["shapes"]:
        rows = [r for r in result["rows"] if r["shape"] == info["shape"]]
        lines += [f"### {info['shape']}: {info['architecture']}, {info['parameters'] / 1e6:,.1f} M parameters", "",
                  "Prefill, tokens/s:", "", *prefill_table(rows, plan["prefill"]), "",
                  "Decode, tokens/s (all streams together):", "",
                  *decode_table(rows, plan["decode_after"], plan["batches"]), "",
                  *system_table(rows, result["bandwidth_after"], result["read_gb_per_s"]), ""]
    lines += ["### Targets", "", *target_lines(result["targets"]), ""]
    if result["notes"]:
        lines += ["### Notes", "", *(f"- {shown(n)}" for n in result["notes"]), ""]
    lines += ["### Settings", "", *(f"- {shown(s)}" for s in result["rules"]), *settings_lines(result["rows"])]
    return "\n".join(lines) + "\n"
