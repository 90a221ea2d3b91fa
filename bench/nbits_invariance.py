"""`python -m bench.nbits_invariance`: whether onnxruntime's 4-bit `MatMulNBits` gives a row the same bits alone
and among other rows in one call, per configuration, on this CPU or under qemu's emulation of another.

    python -m bench.nbits_invariance [--quick]
    python -m bench.nbits_invariance --emulate Haswell [--quick]

A configuration is a block size (16, 32, 64, 128), an accuracy level (0 and 1: fp32 compute; 4: int8
activations), onnxruntime's intra-op threads (1, 2) and a layout: how the runner shapes a call of M rows
(as called; padded with zero rows to at least 2 rows, to an even count, or to a multiple of 4). Each is one
`MatMulNBits` node built with onnx.helper at each of Qwen2.5-0.5B's MatMul shapes (K×N 896×896, 896×4864,
4864×896), on random fp32 weights packed as `attnserve export --int4` packs them
(`export.block_quantization.pack_blocks`: symmetric, no zero points), fed 8 random fp32 rows. Each row is
scored alone (one row, padded as the layout pads it) and at every position of calls of M = 2..8 rows (8
rotations of the rows, 1 with --quick); the table gives the comparisons, whether every one was the same
bits, the largest |difference|, the row counts M at which some row differed and the positions in the call
of the rows that did (a 1-row or odd-row tail path shows as the last position of odd M).

Natively, each configuration's batch-1 and batch-8 calls are also timed (the three shapes one after the
other, medians of repeated calls), against `--int4`'s block 32 at accuracy level 4 as called. With
`--emulate CPU` the comparisons run in a child under `qemu-x86_64 -cpu CPU` (Haswell: AVX2 without VNNI or
AVX-512), which first shows that onnxruntime took the AVX2 integer kernel there (a u8s8 product that
saturates only on it); emulated times mean nothing and are left out. Emulation runs 30-100x slower: the whole
set with --quick takes over half an hour on 2 cores, and `--block-sizes`, `--accuracy-levels` and `--threads`
choose a subset.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from itertools import product
from pathlib import Path

import numpy as np

from bench.machine import ROOT, describe, machine_line

SHAPES = ((896, 896), (896, 4864), (4864, 896))  # (K, N): Qwen2.5-0.5B's q/o, gate/up and down projections
BLOCK_SIZES = (16, 32, 64, 128)
ACCURACY_LEVELS = (0, 1, 4)
THREADS = (1, 2)
LAYOUTS: dict[str, Callable[[int], int]] = {  # the rows a call of m rows is padded to
    "as called": lambda m: m,
    "≥ 2 rows": lambda m: max(m, 2),
    "even rows": lambda m: m + m % 2,
    "rows × 4": lambda m: -(-m // 4) * 4,
}
ROWS = 8  # input rows, and the largest call
SHIFTS, QUICK_SHIFTS = ROWS, 1  # rotations of the rows each call size is run with
INT4 = (32, 4, 1, "as called")  # what --int4 writes, as the runner calls it: the times' reference
PAD = -1  # a padding row's id: zeros
SATURATED = 32 * 32767  # the probe's product on AVX2 without VNNI, whose pair sums saturate


def nbits_model(k: int, n: int, block_size: int, accuracy_level: int, seed: int) -> bytes:
    """One `MatMulNBits` y = x @ W, W (k, n) random, in 4-bit blocks of `block_size` as the export writes them."""
    from onnx import TensorProto, helper, numpy_helper

    from export.block_quantization import pack_blocks
    from export.weight_matmuls import MS_DOMAIN

    w = np.random.default_rng(seed).normal(0, 0.02, (k, n)).astype(np.float32)
    packed, scales = pack_blocks(w, 4, block_size)
    level = {"accuracy_level": accuracy_level} if accuracy_level else {}
    node = helper.make_node("MatMulNBits", ["x", "w_q", "scales"], ["y"], domain=MS_DOMAIN, K=k, N=n, bits=4,
                            block_size=block_size, **level)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(packed, "w_q"), numpy_helper.from_array(scales, "scales")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(MS_DOMAIN, 1)]).SerializeToString()


class Calls:
    """One session and its outputs by the rows it was called with (row ids into `x`, PAD for a zero row)."""

    def __init__(self, model: bytes, threads: int, x: np.ndarray):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        self.x, self.done = x, {}

    def input(self, rows: tuple[int, ...]) -> np.ndarray:
        return np.stack([self.x[r] if r != PAD else np.zeros_like(self.x[0]) for r in rows])

    def __call__(self, rows: tuple[int, ...]) -> np.ndarray:
        if rows not in self.done:
            self.done[rows] = self.session.run(None, {"x": self.input(rows)})[0]
        return self.done[rows]


def padded(rows: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return rows + (PAD,) * (LAYOUTS[layout](len(rows)) - len(rows))


def compare(calls: Calls, layout: str, shifts: int) -> dict:
    """Each row alone against the same row at every position of calls of 2..ROWS rows, padded as `layout` pads."""
    alone = {r: calls(padded((r,), layout))[0] for r in range(ROWS)}
    compared, differing, worst, sizes, positions = 0, 0, 0.0, set(), set()
    for m, s in product(range(2, ROWS + 1), range(shifts)):
        rows = tuple((s + i) % ROWS for i in range(m))
        out = calls(padded(rows, layout))
        for i, r in enumerate(rows):
            compared += 1
            if not np.array_equal(out[i], alone[r]):
                differing += 1
                sizes.add(m)
                positions.add(i)
                worst = max(worst, float(np.abs(out[i] - alone[r]).max()))
    return {"compared": compared, "differing": differing, "identical": not differing, "max_abs_diff": worst,
            "differs_at": sorted(sizes), "positions": sorted(positions)}


def call_ms(calls: Calls, rows: tuple[int, ...], repeats: int) -> list[float]:
    x = calls.input(rows)
    calls.session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls.session.run(None, {"x": x})
        times.append((time.perf_counter() - start) * 1e3)
    return times


def timings(sessions: list[tuple[tuple, Calls]], rounds: int, repeats: int) -> dict[tuple, dict]:
    """ms per batch-1 and batch-ROWS call of each (block, level, threads) and layout, summed over its sessions (the
    shapes), each the median of `rounds` rounds of `repeats` calls; every call shape in turn in each round."""
    called = {padded(tuple(range(b)), layout) for layout in LAYOUTS for b in (1, ROWS)}  # each timed once
    samples = defaultdict(list)
    for _, (i, (_, calls)), rows in product(range(rounds), enumerate(sessions), sorted(called)):
        samples[i, rows] += call_ms(calls, rows, repeats)
    out = defaultdict(dict)
    for (i, (key, _)), layout, b in product(enumerate(sessions), LAYOUTS, (1, ROWS)):
        ms = statistics.median(samples[i, padded(tuple(range(b)), layout)])
        out[key + (layout,)][f"ms_b{b}"] = out[key + (layout,)].get(f"ms_b{b}", 0.0) + ms
    return out


def measure(quick: bool, timed: bool, blocks=BLOCK_SIZES, levels=ACCURACY_LEVELS, threads=THREADS) -> list[dict]:
    """A row per configuration, over every shape: the comparisons and (when `timed`) ms per batch-1 and -8 call."""
    shifts, rounds, repeats = (QUICK_SHIFTS, 1, 5) if quick else (SHIFTS, 5, 10)
    rows, sessions = {}, []
    for (k, n), block, level in product(SHAPES, blocks, levels):
        model = nbits_model(k, n, block, level, seed=k * 10007 + n)
        x = np.random.default_rng(k + n).standard_normal((ROWS, k)).astype(np.float32)
        for intra in threads:
            calls = Calls(model, intra, x)
            for layout in LAYOUTS:
                row = rows.setdefault((block, level, intra, layout), {})
                for key, value in compare(calls, layout, shifts).items():
                    row[key] = merged(key, row.get(key), value)
            calls.done.clear()
            if timed:
                sessions.append(((block, level, intra), calls))
    for key, ms in timings(sessions, rounds, repeats).items() if timed else ():
        rows[key] |= ms
    return [{"block": b, "accuracy": a, "threads": t, "layout": lay, **r} for (b, a, t, lay), r in rows.items()]


def merged(key: str, before, value):
    """A column over the shapes: comparisons and times add up, the worst difference and verdict hold."""
    if before is None:
        return value
    if key == "identical":
        return before and value
    if key == "max_abs_diff":
        return max(before, value)
    if key in ("differs_at", "positions"):
        return sorted(set(before) | set(value))
    return before + value


def saturating_product() -> int:
    """255 × 127 summed over 64 terms by onnxruntime's u8s8 MatMulInteger: 2072640 where the integer kernel is exact,
    SATURATED on AVX2 without VNNI (VPMADDUBSW saturates each pair sum at 32767)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "saturation",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
                              [numpy_helper.from_array(np.full((64, 1), 127, np.int8), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return int(session.run(None, {"a": np.full((1, 64), 255, np.uint8)})[0].item())


def emulated(cpu: str, quick: bool, configurations: list[str]) -> list[dict]:
    """`measure` (untimed) in a child under `qemu-x86_64 -cpu <cpu>`, which must take the AVX2 integer kernel."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise SystemExit("--emulate needs qemu-x86_64 (Debian: apt-get install qemu-user)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [qemu, "-cpu", cpu, sys.executable, "-m", "bench.nbits_invariance", "--child-json", str(out)]
        cmd += configurations + (["--quick"] if quick else [])
        child = subprocess.run(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        if child.returncode != 0:  # qemu warns of every CPUID feature it lacks: show the child's own last words
            said = [line for line in child.stderr.splitlines() if not line.startswith("qemu-x86_64: warning")]
            raise SystemExit(f"the emulated child failed ({child.returncode}):\n" + "\n".join(said[-20:]))
        result = json.loads(out.read_text())
    if result["product"] != SATURATED:
        raise SystemExit(f"under qemu -cpu {cpu} the u8s8 probe gave {result['product']}, not {SATURATED}: "
                         "onnxruntime did not take the AVX2 kernel without VNNI")
    return result["rows"]


COLUMNS = (("block", lambda r, ref: str(r["block"])), ("accuracy level", lambda r, ref: str(r["accuracy"])),
           ("threads", lambda r, ref: str(r["threads"])), ("layout", lambda r, ref: r["layout"]),
           ("rows compared", lambda r, ref: str(r["compared"])),
           ("identical", lambda r, ref: "yes" if r["identical"] else f"**no** ({r['differing']} differ)"),
           ("max abs diff", lambda r, ref: f"{r['max_abs_diff']:.3g}"),
           ("differs at M", lambda r, ref: ",".join(map(str, r["differs_at"])) or "–"),
           ("at positions", lambda r, ref: ",".join(map(str, r["positions"])) or "–"))
TIMES = tuple((label, fn) for b in (1, ROWS) for label, fn in (
    (f"ms, batch {b}", lambda r, ref, b=b: f"{r[f'ms_b{b}']:.3f}"),
    (f"× b32 level 4, batch {b}", lambda r, ref, b=b: f"{r[f'ms_b{b}'] / ref[f'ms_b{b}']:.2f}×" if ref else "–")))


def render(rows: list[dict], heading: str) -> str:
    columns = COLUMNS + (TIMES if "ms_b1" in rows[0] else ())
    ref = next((r for r in rows if (r["block"], r["accuracy"], r["threads"], r["layout"]) == INT4), None)
    lines = [heading, "", "| " + " | ".join(label for label, _ in columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(fn(r, ref) for _, fn in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nbits_invariance", description=__doc__.split("\n\n")[0])
    p.add_argument("--emulate", metavar="CPU", help="compare under qemu-x86_64 -cpu CPU (e.g. Haswell), untimed")
    p.add_argument("--quick", action="store_true", help="one rotation of the rows, few timed calls: checks it runs")
    p.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    p.add_argument("--accuracy-levels", default=",".join(map(str, ACCURACY_LEVELS)))
    p.add_argument("--threads", default=",".join(map(str, THREADS)), help="onnxruntime intra-op threads")
    p.add_argument("--out", type=Path, help="also write the rows as JSON here")
    p.add_argument("--child-json", type=Path, help=argparse.SUPPRESS)  # the emulated child: its rows go here
    args = p.parse_args(argv)
    numbers = lambda text: tuple(int(v) for v in text.split(",") if v)
    chosen = dict(blocks=numbers(args.block_sizes), levels=numbers(args.accuracy_levels), threads=numbers(args.threads))
    configurations = [f"--block-sizes={args.block_sizes}", f"--accuracy-levels={args.accuracy_levels}",
                      f"--threads={args.threads}"]  # handed to the emulated child

    if args.child_json:
        saturation = saturating_product()
        args.child_json.write_text(json.dumps({"product": saturation, "rows": measure(args.quick, False, **chosen)}))
        return 0
    machine = machine_line(describe())
    if args.emulate:
        rows = emulated(args.emulate, args.quick, configurations)
        heading = f"#### `qemu-x86_64 -cpu {args.emulate}` on {machine}"
    else:
        rows = measure(args.quick, True, **chosen)
        heading = f"#### {machine}"
    print(render(rows, heading + (" (--quick: one rotation of the rows, few timed calls)" if args.quick else "")))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "emulated": args.emulate, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
