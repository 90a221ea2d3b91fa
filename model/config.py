"""Model configuration: the hyperparameters that fix a GPT's shape.

`GPTConfig` is written next to the weights as `config.json`, so a model directory is
self-describing. Field names follow our own vocabulary; `import_hf` maps Hugging Face
GPT-2 names onto them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal


@dataclass
class GPTConfig:
    vocab_size: int = 4096  # number of token ids the embedding and the output head cover
    n_ctx: int = 256  # longest sequence (prompt + generated) the model attends over
    n_layer: int = 4  # number of Transformer blocks
    n_head: int = 4  # attention heads per block; d_model must divide evenly among them
    d_model: int = 256  # width of the residual stream
    d_ff: int | None = None  # hidden width of the feed-forward; None means 4 * d_model
    dropout: float = 0.0  # dropout on the embeddings and on each residual branch
    attn_dropout: float = 0.0  # dropout on attention weights; > 0 rules out torch's fused attention kernel
    bias: bool = True  # biases in the linear layers and LayerNorms (GPT-2 has them)
    layer_norm_eps: float = 1e-5  # epsilon inside every LayerNorm
    pos_encoding: Literal["learned", "sinusoidal"] = "learned"  # how positions enter the stream
    activation: Literal["gelu_tanh", "gelu"] = "gelu_tanh"  # GPT-2 uses the tanh approximation
    eos_token_id: int = 0  # end-of-sequence / document separator id
    bos_token_id: int | None = None  # beginning-of-sequence id, when the tokenizer has one

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.pos_encoding not in ("learned", "sinusoidal"):
            raise ValueError(f"pos_encoding must be 'learned' or 'sinusoidal', got {self.pos_encoding!r}")
        if self.activation not in ("gelu_tanh", "gelu"):
            raise ValueError(f"activation must be 'gelu_tanh' or 'gelu', got {self.activation!r}")

    @property
    def d_head(self) -> int:
        """Per-head key/query/value width, the d_k of the attention scale."""
        return self.d_model // self.n_head

    @property
    def ff_width(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {unknown}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GPTConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
