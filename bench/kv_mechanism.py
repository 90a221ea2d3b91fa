"""The KV cache's memory mechanism in-process, for `attnserve bench memory` (docs/engine.md#kv-cache-memory):

    decode_ratio(runner, batch=32, contexts=(64, 512), positions=2048, rounds=5, steps=6)
    release_and_residency(shape, positions=8000, rounds=5)

- `decode_ratio`: the decode step at `batch` rows and each context, on buffers as the KV cache makes them now
  (`lazy_zeros`: address space reserved, pages taken when written) and as the allocate-once layout made them
  (`np.zeros`, which numpy backs with transparent huge pages where the kernel allows them), both
  `[batch, kv heads, positions, d_head]` and attached to the same runner through `StaticRunner.attach`. Keys and
  values are random numbers written straight into the buffers (a step's cost does not depend on them), so no
  prefill is timed or waited for. Each round runs, per context, the two layouts back to back (which goes first
  alternates); a run's figure is the median of its `steps` timed steps (after one untimed step that builds the
  IO binding). The speed ratio is the median over rounds of each round's before/now, so a slow moment of a
  shared machine falls on both sides of a ratio; the times are medians over rounds.
- `release_and_residency`: a real `KVCache` at the model's context: this process's resident set
  (/proc/self/statm) before and after writing `positions` positions of a slot and after `KVCache.release`
  gives its pages back; and the time `release` takes, for the last slot (pages only) and for a slot whose
  place the last slot's sequence (as long) moves into (a copy of its live prefix, then the pages).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import numpy as np

from service.engine.kv_cache import KVCache
from service.runtime.memory import lazy_zeros, resident_bytes
from service.runtime.static_runner import CacheShape, StaticRunner

LAYOUTS = ("lazy pages (now)", "allocated once (before)")


def layout_buffers(shape: CacheShape, batch: int, layout: str) -> list[np.ndarray]:
    if layout == LAYOUTS[1]:
        return shape.buffers(batch)
    dims = (batch, shape.n_head, shape.max_seq, shape.d_head)
    return [lazy_zeros(dims, shape.dtype) for _ in range(2 * shape.n_layer)]


def fill(buffers: list[np.ndarray], positions: int, rng: np.random.Generator) -> None:
    """Random keys and values in positions [0, positions) of every slot, as a prefill would leave them."""
    for buf in buffers:
        buf[:, :, :positions] = rng.standard_normal(buf[:, :, :positions].shape, dtype=np.float32).astype(buf.dtype)


def step_ms(runner: StaticRunner, batch: int, context: int, steps: int, rng: np.random.Generator) -> float:
    """Median ms of `steps` decode steps whose rows each hold `context` positions (one untimed step first)."""
    positions = np.full(batch, context, dtype=np.int64)  # each step writes position `context`, reads 0..context
    times = []
    for i in range(steps + 1):
        ids = rng.integers(1, runner.vocab_size, batch)
        started = time.perf_counter()
        runner.decode(ids, positions)
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def decode_ratio(runner: StaticRunner, batch: int, contexts: list[int], positions: int, rounds: int,
                 steps: int, progress=print) -> dict:
    """Median decode step ms per layout and context, and now/before speed ratios (>= 0.9 wanted)."""
    if positions <= max(contexts):
        raise ValueError(f"slots of {positions} positions cannot hold a context of {max(contexts)} plus a step")
    shape = replace(runner.cache_shape, max_seq=positions)
    rng = np.random.default_rng(0)
    caches = {layout: layout_buffers(shape, batch, layout) for layout in LAYOUTS}
    for buffers in caches.values():
        fill(buffers, max(contexts), rng)
    per_round: dict[str, dict[int, list[float]]] = {layout: {c: [] for c in contexts} for layout in LAYOUTS}
    for r in range(rounds):
        for i, context in enumerate(contexts):  # the two layouts back to back, first one then the other first
            for layout in (LAYOUTS if (r + i) % 2 == 0 else LAYOUTS[::-1]):
                runner.attach(caches[layout])
                per_round[layout][context].append(step_ms(runner, batch, context, steps, rng))
        progress(f"decode round {r + 1}/{rounds}: " + ", ".join(
            f"{layout} ctx {c} {per_round[layout][c][-1]:.1f} ms" for layout in LAYOUTS for c in contexts))
    del caches
    medians = {layout: {c: statistics.median(v) for c, v in by_context.items()}
               for layout, by_context in per_round.items()}
    now, before = LAYOUTS
    ratios = {c: [b / n for b, n in zip(per_round[before][c], per_round[now][c], strict=True)] for c in contexts}
    return {"batch": batch, "contexts": contexts, "slot_positions": positions, "rounds": rounds, "steps": steps,
            "graph": runner.graph_name, "round_ms": {layout: {str(c): v for c, v in by.items()}
                                                    for layout, by in per_round.items()},
            "median_ms": {layout: {str(c): v for c, v in by.items()} for layout, by in medians.items()},
            "round_ratios": {str(c): v for c, v in ratios.items()},
            "speed_ratio": {str(c): statistics.median(v) for c, v in ratios.items()}}


def write_positions(kv: KVCache, slot: int, positions: int) -> None:
    for buf in kv.buffers:
        buf[slot, :, :positions] = 1.0
    kv.lengths[slot] = positions


def release_and_residency(shape: CacheShape, positions: int, rounds: int) -> dict:
    """Resident memory as a slot is written and released, and the ms `KVCache.release` takes (medians)."""
    positions = min(positions, shape.max_seq)
    per_token = shape.bytes_per_slot // shape.max_seq
    kv = KVCache(shape, n_slots=2)
    before = resident_bytes()
    slot = kv.allocate("probe", kv.blocks_for(positions))
    write_positions(kv, slot, positions)
    written = resident_bytes()
    kv.release(slot)
    released = resident_bytes()
    last_ms, moved_ms = [], []
    for _ in range(rounds):
        slot = kv.allocate("last", kv.blocks_for(positions))
        write_positions(kv, slot, positions)
        started = time.perf_counter()
        kv.release(slot)
        last_ms.append((time.perf_counter() - started) * 1e3)
        first, second = kv.allocate("first", kv.blocks_for(positions)), kv.allocate("second", kv.blocks_for(positions))
        write_positions(kv, first, positions)
        write_positions(kv, second, positions)
        started = time.perf_counter()
        kv.release(first)  # `second` moves into slot 0
        moved_ms.append((time.perf_counter() - started) * 1e3)
        kv.release(0)
    after_rounds = resident_bytes()
    return {"positions": positions, "bytes_per_position": per_token, "expected_bytes": positions * per_token,
            "rss_before": before, "rss_written": written, "rss_released": released, "rss_after_rounds": after_rounds,
            "release_ms": statistics.median(last_ms), "release_moved_ms": statistics.median(moved_ms),
            "release_ms_rounds": last_ms, "release_moved_ms_rounds": moved_ms, "rounds": rounds,
            "context": shape.max_seq}
