"""Engine configuration: one pydantic object, built once at start-up and passed in."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator


class EngineConfig(BaseModel):
    bundle: Path  # ONNX bundle directory (attnserve export)
    graph: str | None = None  # graph variant; None = the bundle's static-cache default
    provider: Literal["auto", "cpu", "cuda"] = "cpu"
    intra_op_threads: int = Field(0, ge=0)  # onnxruntime threads per op; 0 = one per core
    max_running: int = Field(64, ge=1)  # sequences decoded together (KV slots)
    max_waiting: int = Field(256, ge=0)  # requests queued beyond that; more are refused with Overloaded
    max_batch_tokens: int = Field(512, ge=2)  # tokens per step: one per running sequence plus prefill
    kv_cache_bytes: int | None = Field(None, ge=1)  # cap on KV memory; None = max_running full-length slots
    max_new_tokens: int | None = Field(None, ge=1)  # cap on a request's max_new_tokens; None = context - 1
    max_prompt_tokens: int | None = Field(None, ge=1)  # cap on prompt length; None = context - 1

    @model_validator(mode="after")
    def _budget_leaves_room_for_prefill(self) -> EngineConfig:
        if self.max_batch_tokens <= self.max_running:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must exceed max_running "
                             f"({self.max_running}): each step spends one token per running sequence and "
                             "needs room left to prefill new prompts")
        return self
