"""How the engine's memory is laid out, decided once at start-up: the positions each sequence may use,
the prefix cache, and how many KV slots fit beside it in the budget.

    plan = plan_caches(config, runner)   # CachePlan(context, shape, n_slots, prefixes)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from service.engine.config import EngineConfig
from service.engine.kv_cache import plan_slots
from service.engine.prefix_cache import PrefixCache
from service.runtime.static_runner import CacheShape, StaticRunner

PREFIX_BLOCK_TOKENS = 16
DEFAULT_PREFIX_CONTEXTS = 4  # the prefix cache holds this many full contexts unless told otherwise


@dataclass(frozen=True)
class CachePlan:
    context: int  # positions per sequence, prompt and completion
    shape: CacheShape  # a KV slot's shape (max_seq = context)
    n_slots: int
    prefixes: PrefixCache | None  # None when prefix caching is off (always for an encoder-decoder)


def plan_caches(config: EngineConfig, runner: StaticRunner) -> CachePlan:
    """The plan for `runner`'s model under `config`; ValueError when the budget cannot hold it."""
    model = runner.manifest.model
    context = served_context(config, model.n_ctx)
    shape = replace(runner.cache_shape, max_seq=context)
    # an encoder-decoder's prompt is its source, encoded apart: there is no prefix to share
    prefixes = None if model.encoder_decoder else plan_prefix_cache(shape, config)
    budget = config.kv_cache_bytes
    if budget is not None and prefixes is not None:
        if prefixes.nbytes >= budget:
            raise ValueError(f"the prefix cache ({prefixes.nbytes} bytes) leaves no room for a sequence in "
                             f"kv_cache_bytes={budget}: lower prefix_cache_tokens or raise the budget")
        budget -= prefixes.nbytes
    n_slots = plan_slots(shape, config.max_running, budget, runner.slot_state_bytes())
    return CachePlan(context, shape, n_slots, prefixes)


def plan_prefix_cache(shape: CacheShape, config: EngineConfig) -> PrefixCache | None:
    """The prefix cache the config asks for (None when it is off or holds less than one block)."""
    if not config.prefix_caching:
        return None
    tokens = config.prefix_cache_tokens
    if tokens is None:
        tokens = DEFAULT_PREFIX_CONTEXTS * shape.max_seq
    n_blocks = tokens // PREFIX_BLOCK_TOKENS
    return PrefixCache(shape, n_blocks, PREFIX_BLOCK_TOKENS) if n_blocks else None


def served_context(config: EngineConfig, n_ctx: int) -> int:
    """The positions each sequence may use: `config.max_context`, at most the model's `n_ctx`."""
    if config.max_context is None:
        return n_ctx
    if config.max_context > n_ctx:
        raise ValueError(f"max_context={config.max_context} exceeds the model context of {n_ctx} positions")
    return config.max_context
