"""How the engine's memory is planned, once at start-up: the positions each sequence may use, and how many
blocks of KV cache the memory budget holds beside the loaded model (docs/engine.md#kv-cache-memory).

    plan = plan_caches(config, runner)   # CachePlan: context, shape, n_slots, block_tokens, n_blocks, prefixes
    kv = kv_shares(config, [(spec, weight_bytes), ...], held)   # several models: each one's KV, before any loads
    plan = plan_caches(config, runner, kv_bytes=kv[i])           # ... granted by the model pool

The budget is `memory_budget` (a fraction of the memory limit: the container's cgroup limit, else physical
memory; or a size). Out of it come what the process holds once the model is loaded (weights, onnxruntime's
sessions and arenas, Python), measured, and the activations of the largest step, estimated from the shapes
(`activation_bytes`); the rest is the KV cache, shared by the sequences and the prefix cache, unless
`kv_cache_bytes` names a smaller one. A plan that cannot hold one sequence at the served context is refused
with the settings that fix it. Several models in one process share the budget: once all are loaded, each
engine's KV cache is planned before any of them loads (`kv_shares`): an equal part of what their weights and
largest steps leave, no more than the model's running sequences can fill and no less than one sequence; the
model pool keeps the sum of what loaded models take within the budget (service/fronts/model_pool.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from service.engine.config import EngineConfig
from service.engine.kv_cache import BLOCK_TOKENS, block_tokens_for
from service.engine.prefix_cache import PrefixCache
from service.runtime.bundle import ModelSpec
from service.runtime.memory import MemoryLimit, budget_bytes, memory_limit, resident_bytes
from service.runtime.static_runner import CacheShape, StaticRunner

log = logging.getLogger(__name__)

MARGIN_BYTES = 256 * 2**20  # Python's own growth, the tokenizer's caches, the fronts' buffers
GiB, MiB = 2**30, 2**20


@dataclass(frozen=True)
class MemoryPlan:
    """What the budget was and where it went (the start-up log states it)."""

    limit: MemoryLimit
    budget: int  # bytes the process may use
    model: int  # resident once the model was loaded (before the KV cache)
    activations: int  # the largest step's temporaries, estimated
    kv: int  # the KV cache's blocks: sequences and prefix cache

    def describe(self, setting: str) -> str:
        return (f"memory budget {self.budget / GiB:.1f} GiB (memory_budget={setting} of {self.limit.bytes / GiB:.1f} "
                f"GiB, {self.limit.source}): model {self.model / GiB:.2f} GiB resident, activations up to "
                f"{self.activations / GiB:.2f} GiB, KV cache {self.kv / GiB:.2f} GiB")


@dataclass(frozen=True)
class CachePlan:
    context: int  # positions per sequence, prompt and completion
    shape: CacheShape  # a KV slot's shape (max_seq = context)
    n_slots: int  # rows a step may run (address space only)
    block_tokens: int  # positions per block of KV memory
    n_blocks: int  # blocks the KV cache may hold: the sequences' and the prefix cache's
    prefixes: PrefixCache | None  # None when prefix caching is off (always for an encoder-decoder)
    memory: MemoryPlan

    @property
    def tokens(self) -> int:
        return self.n_blocks * self.block_tokens


def plan_caches(config: EngineConfig, runner: StaticRunner, kv_bytes: int | None = None) -> CachePlan:
    """The plan for `runner`'s model under `config`; ValueError when the budget cannot hold it. `kv_bytes`: the
    KV cache granted by whoever keeps the budget for several models (then nothing is measured here)."""
    model = runner.manifest.model
    context = served_context(config, model.n_ctx)
    shape = replace(runner.cache_shape, max_seq=context)
    block_tokens = block_tokens_for(shape)
    per_token = shape.bytes_per_slot // shape.max_seq
    state = runner.slot_state_bytes() * config.max_running  # an encoder-decoder's sources, allocated whole
    if kv_bytes is None:
        memory = plan_memory(config, model, shape, state)
    else:
        limit = memory_limit()
        memory = MemoryPlan(limit, budget_bytes(config.memory_budget, limit), resident_bytes(),
                            activation_bytes(model, context, config), kv_bytes)
    n_blocks = (memory.kv - state) // (per_token * block_tokens)
    one = -(-context // block_tokens)
    if n_blocks < one:
        fits = max(n_blocks, 0) * block_tokens
        sources = f", of which {state / MiB:.0f} MiB of source state" if state else ""
        raise ValueError(
            f"the KV cache cannot hold one sequence of {context} positions ({one * block_tokens * per_token / MiB:.1f} "
            f"MiB): {memory.describe(config.memory_budget)}{sources}. Lower max_context (--max-context; {fits} "
            "positions fit), or raise memory_budget (--memory-budget) or kv_cache_bytes, or the container's memory")
    # an encoder-decoder's prompt is its source, encoded apart: there is no prefix to share
    prefixes = None if model.encoder_decoder else plan_prefix_cache(shape, config, block_tokens, n_blocks)
    return CachePlan(context, shape, config.max_running, block_tokens, n_blocks, prefixes, memory)


def plan_memory(config: EngineConfig, model: ModelSpec, shape: CacheShape, state_bytes: int = 0) -> MemoryPlan:
    """Split the budget: the loaded model (measured now), the activations (estimated), the rest for KV."""
    limit = memory_limit()
    budget = budget_bytes(config.memory_budget, limit)
    held = resident_bytes()
    activations = activation_bytes(model, shape.max_seq, config)
    kv = budget - held - activations - MARGIN_BYTES
    if config.kv_cache_bytes is not None:
        if config.kv_cache_bytes > kv:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} ({config.kv_cache_bytes / GiB:.2f} GiB) does not "
                             f"fit: {MemoryPlan(limit, budget, held, activations, kv).describe(config.memory_budget)}. "
                             "Lower kv_cache_bytes or raise memory_budget")
        kv = config.kv_cache_bytes
    return MemoryPlan(limit, budget, held, activations, max(kv, 0))


def kv_shares(config: EngineConfig, models: list[tuple[ModelSpec, int]], held: int) -> list[int]:
    """The KV cache of each of `models` (each with the bytes its weights are expected to take), served by one
    process that holds `held` bytes before any of them loads: `kv_cache_bytes` when set; otherwise an equal part
    of the budget that their weights, their largest steps and the margin leave, at most what the model's
    `max_running` sequences can fill at the served context and at least one sequence's worth (a budget too
    small for all of them at once then holds fewer loaded together)."""
    if not models:
        return []
    limit = memory_limit()
    budget = budget_bytes(config.memory_budget, limit)
    fixed = sum(weights + activation_bytes(m, served_context(config, m.n_ctx), config) for m, weights in models)
    share = max((budget - held - fixed - MARGIN_BYTES) // len(models), 0)
    shares = []
    for model, _ in models:
        if config.kv_cache_bytes is not None:
            shares.append(config.kv_cache_bytes)
            continue
        sequence, state = sequence_bytes(config, model), config.max_running * source_bytes(config, model)
        shares.append(min(config.max_running * sequence + state, max(sequence + state, share)))
    return shares


def sequence_bytes(config: EngineConfig, model: ModelSpec) -> int:
    """What one sequence at the served context takes of a KV cache: its keys and values in every layer, in
    whole blocks."""
    context = served_context(config, model.n_ctx)
    positions = -(-context // BLOCK_TOKENS) * BLOCK_TOKENS
    return 2 * model.n_layer * model.kv_heads * model.d_head * np.dtype(config.kv_dtype).itemsize * positions


def source_bytes(config: EngineConfig, model: ModelSpec) -> int:
    """An encoder-decoder's state per sequence slot, allocated whole: the cross-attention keys and values of
    its longest source, and the source's mask (0 for a decoder-only model)."""
    if not model.encoder_decoder:
        return 0
    positions = config.max_source_tokens or model.n_src_ctx or 0
    return 2 * model.n_layer * model.kv_heads * model.d_head * 4 * positions + 8 * positions


def activation_bytes(model: ModelSpec, context: int, config: EngineConfig) -> int:
    """The temporaries of the largest step, from onnxruntime's kernels: GroupQueryAttention's scores,
    [rows, query heads, queries, positions of the cache] fp32 (a prefill chunk of max_batch_tokens queries at
    the full context is the largest; a speculative verification runs drafts + 1 queries per row), the logits of
    every position of a prefill, and the hidden states and feed-forward of each token (a generous 32 × d_model
    floats)."""
    drafts = config.speculative_tokens if config.speculative != "off" else 0
    queries = max(config.max_batch_tokens, config.max_running * (1 + drafts))
    scores = queries * model.n_head * context * 4
    logits = 2 * queries * model.vocab_size * 4
    hidden = queries * 32 * model.d_model * 4
    return scores + logits + hidden


def plan_prefix_cache(shape: CacheShape, config: EngineConfig, block_tokens: int, n_blocks: int) -> PrefixCache | None:
    """The prefix cache the config asks for: up to `prefix_cache_tokens` (default: every block of the KV cache
    that sequences leave free), in the KV cache's blocks. None when it is off or holds less than one block."""
    if not config.prefix_caching:
        return None
    cap = n_blocks if config.prefix_cache_tokens is None else min(config.prefix_cache_tokens // block_tokens, n_blocks)
    return PrefixCache(shape, cap, block_tokens) if cap else None


def served_context(config: EngineConfig, n_ctx: int) -> int:
    """The positions each sequence may use: `config.max_context`, at most the model's `n_ctx`."""
    if config.max_context is None:
        return n_ctx
    if config.max_context > n_ctx:
        raise ValueError(f"max_context={config.max_context} exceeds the model context of {n_ctx} positions")
    return config.max_context
