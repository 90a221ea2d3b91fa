"""What the engine needs to run: the bundle, the graph, and its limits (one pydantic object)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.runtime.bundle import AUTO_GRAPH, KvDtype
from service.runtime.memory import check_budget

DEFAULT_BUNDLE = Path(__file__).resolve().parents[2] / "models" / "shakespeare-onnx"


class EngineConfig(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)  # each field's docstring is its description

    bundle: Path = DEFAULT_BUNDLE
    """ONNX bundle directory (attnserve export)"""
    graph: str = AUTO_GRAPH
    """graph to serve; auto = the fastest of the bundle's serving graphs that passes the start-up self-check on this
    CPU"""
    kv_dtype: KvDtype = "float32"
    """what the KV cache holds: float16 halves its memory, int8 quarters it (the bundle needs a graph exported with
    attnserve export --kv-dtype; it must pass the start-up self-check against the fp32 graph). graph auto chooses
    among the graphs with this cache"""
    allow_low_agreement: bool = False
    """serve the graph named by graph even if it fails the start-up agreement check with the fp32 graph (a warning
    says so); for benchmarking untrained weights. Ignored by auto"""
    providers: Literal["auto", "cpu", "cuda"] = "cpu"
    """onnxruntime execution provider: cpu, cuda, or auto (cuda where onnxruntime offers it); off the CPU the graph
    must reproduce the CPU at start-up"""
    threads: int = Field(0, ge=0)
    """onnxruntime threads per operator; 0 = one per core"""
    max_running: int = Field(64, ge=1)
    """sequences decoded together (KV cache slots: address space only, memory is taken per block of tokens
    written)"""
    max_waiting: int = Field(256, ge=0)
    """requests queued beyond max_running; more get RESOURCE_EXHAUSTED"""
    max_batch_tokens: int = Field(512, ge=2)
    """tokens per model step: one per running sequence plus prompt prefill"""
    max_context: int | None = Field(None, ge=2)
    """positions a sequence may use, prompt + completion; unset = the model context. The memory budget must hold
    one sequence of it"""
    memory_budget: str = "0.65"
    """memory the server may use, model and KV cache together: a fraction of the memory limit (the container's
    cgroup limit, else physical memory), e.g. 0.65, or a size, e.g. 12GiB. The KV cache gets what the loaded model
    and its activations leave"""
    kv_cache_bytes: int | None = Field(None, ge=1)
    """KV cache memory, the prefix cache included; unset = all that memory_budget leaves for it (a value must fit
    in that)"""
    prefix_caching: bool = True
    """keep the keys and values of prompt prefixes for later requests that start with them"""
    prefix_cache_tokens: int | None = Field(None, ge=0)
    """most positions the prefix cache keeps, in the KV cache's blocks (16 positions for most models); unset = as
    many as running sequences leave free (they take blocks back from it as they need them)"""
    max_new_tokens: int | None = Field(None, ge=1)
    """limit on a request's max_new_tokens; unset = the model context - 1"""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """limit on prompt tokens; unset = the context - 1"""
    max_source_tokens: int | None = Field(None, ge=1)
    """an encoder-decoder's longest source: each KV slot holds this many source positions of cross-attention
    keys and values (a smaller one reserves less memory per sequence and reads less per step; logits then agree
    with the full width's to about 1e-6); unset = the model's longest source. Refused for a decoder-only bundle"""
    default_max_new_tokens: int = Field(64, ge=1)
    """max_new_tokens of a request that leaves it 0"""
    speculative: Literal["off", "ngram"] = "off"
    """speculative decoding: off, or ngram (prompt lookup: drafts from the request's own prompt and output, checked
    by the model in a call per sequence where the measured call times say it pays). Sampled output keeps its
    distribution; greedy output is the same text except where the two likeliest tokens lie within onnxruntime's
    rounding, and logprobs agree to about 1e-5 (docs/speculative.md)"""
    speculative_tokens: int = Field(4, ge=1, le=15)
    """most drafts a sequence proposes per step (fewer where its acceptance makes fewer faster)"""

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget_reads(cls, value: object) -> str:
        return check_budget(value)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _budget_leaves_room_for_prefill(self) -> EngineConfig:
        if self.max_batch_tokens <= self.max_running:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must exceed max_running "
                             f"({self.max_running}): each step spends one token per running sequence and "
                             "needs room left to prefill new prompts")
        return self
