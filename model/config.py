"""Model configuration: the hyperparameters that fix a decoder's shape.

`GPTConfig` is written next to the weights as `config.json`, so a model directory is self-describing. One
decoder covers GPT-2 and the Llama family: the fields choose the positions (learned, sinusoidal or rotary),
the norm (LayerNorm or RMSNorm), the feed-forward (GELU, SwiGLU or GeGLU), the key/value heads (grouped-query
attention when fewer than the query heads), biases, tied embeddings, and the per-head choices of newer
families: a head width of its own (Qwen3, Gemma), an RMSNorm on each query and key head (Qwen3, Gemma 3),
rotary positions on part of each head (Phi-3/4) or on no head at all in some blocks (SmolLM3); sliding-window
attention on some or all layers (Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 2/3), with a rotary base of their
own (Gemma 3); and Gemma's extras: norms after each sublayer too, embeddings scaled by sqrt(d_model), an
attention scale of its own, and tanh soft-capping of the attention scores and the final logits. Field names
follow our own vocabulary; `import_hf` maps Hugging Face names onto them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from model.json_config import JsonConfig

LAYER_TYPES = ("sliding_attention", "full_attention")  # Hugging Face's names for a layer's attention


@dataclass
class GPTConfig(JsonConfig):
    vocab_size: int = 4096  # number of token ids the embedding and the output head cover
    n_ctx: int = 256  # longest sequence (prompt + generated) the model attends over
    n_layer: int = 4  # number of Transformer blocks
    n_head: int = 4  # attention (query) heads per block; d_model must divide evenly among them unless head_dim is set
    n_kv_head: int | None = None  # key/value heads, shared by groups of query heads (GQA); None = n_head
    d_model: int = 256  # width of the residual stream
    head_dim: int | None = None  # query/key/value width per head; None = d_model / n_head (Qwen3 sets its own)
    qk_norm: bool = False  # RMSNorm (weights per head dimension) on each query and key head, before rotary (Qwen3)
    d_ff: int | None = None  # hidden width of the feed-forward; None means 4 * d_model
    dropout: float = 0.0  # dropout on the embeddings and on each residual branch
    attn_dropout: float = 0.0  # dropout on attention weights; > 0 rules out torch's fused attention kernel
    bias: bool = True  # biases in the linear layers and LayerNorms (GPT-2 has them; Llama has none)
    qkv_bias: bool | None = None  # biases on the query/key/value projection alone (Qwen2); None = `bias`
    layer_norm_eps: float = 1e-5  # epsilon inside every norm layer
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    pos_encoding: Literal["learned", "sinusoidal", "rotary"] = "learned"  # how positions enter the model
    rope_theta: float = 10000.0  # rotary base: the angle of pair i at position p is p / theta^(2i/d_head)
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3" | "yarn" | "longrope", ...} as in HF configs
    rope_local_theta: float | None = None  # rotary base of the sliding-window layers when theirs differs (Gemma 3's
    # rope_local_base_freq); they then take rope_local_scaling, the others rope_theta and rope_scaling
    rope_local_scaling: dict | None = None  # the sliding-window layers' rope scaling, with rope_local_theta
    rotary_fraction: float = 1.0  # share of each head's dimensions rotated, the leading ones (Phi-3: 0.75)
    no_rotary_layers: list[int] | None = None  # blocks (indices) whose attention takes no rotary positions (SmolLM3)
    mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"  # GELU MLP (GPT-2), gated SiLU (Llama: down(silu(gate) * up))
    # or gated GELU (Gemma: down(gelu(gate) * up), the GELU of `activation`)
    activation: Literal["gelu_tanh", "gelu"] = "gelu_tanh"  # the GELU MLP's; GPT-2 uses the tanh approximation
    sliding_window: int | None = None  # on a windowed layer a query at position p sees keys p - window + 1 .. p
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention"; None = every layer
    # windowed when sliding_window is set
    post_norms: bool = False  # also normalise each sublayer's output before its residual add (Gemma):
    # x + Norm(Attn(Norm(x))), x + Norm(FFN(Norm(x)))
    scale_embeddings: bool = False  # token embeddings times sqrt(d_model), rounded to the weights' dtype (Gemma)
    attn_scale: float | None = None  # factor on q·k before the softmax; None = 1 / sqrt(d_head)
    attn_softcap: float | None = None  # scores become cap · tanh(scores / cap) before the mask and softmax
    final_softcap: float | None = None  # logits become cap · tanh(logits / cap)
    tie_embeddings: bool = True  # the output head reuses the token embedding matrix
    eos_token_id: int = 0  # end-of-sequence / document separator id
    eos_token_ids: list[int] | None = None  # every id that ends generation, when more than eos_token_id
    bos_token_id: int | None = None  # beginning-of-sequence id, when the tokenizer has one

    def __post_init__(self) -> None:
        if self.head_dim is None and self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads != 0:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        for name, allowed in (("pos_encoding", ("learned", "sinusoidal", "rotary")), ("norm", ("layernorm", "rmsnorm")),
                              ("mlp", ("gelu", "swiglu", "geglu")), ("activation", ("gelu_tanh", "gelu"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.pos_encoding == "rotary" and self.rotary_dim % 2:
            raise ValueError(f"rotary positions need an even rotated width, got {self.rotary_dim} of "
                             f"d_head={self.d_head}")
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ValueError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
        if (self.rotary_fraction != 1.0 or self.no_rotary_layers) and self.pos_encoding != "rotary":
            raise ValueError("rotary_fraction and no_rotary_layers need pos_encoding='rotary'")
        if any(not 0 <= i < self.n_layer for i in self.no_rotary_layers or []):
            raise ValueError(f"no_rotary_layers {self.no_rotary_layers} must be block indices below "
                             f"n_layer={self.n_layer}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 position, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                 f"n_layer={self.n_layer}")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"layer_types must be among {LAYER_TYPES}, got {sorted(unknown)}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head (plain multi-head attention)."""
        return self.n_kv_head or self.n_head

    @property
    def d_head(self) -> int:
        """Per-head key/query/value width, the d_k of the attention scale: head_dim, or d_model / n_head."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each query and key head rotary positions rotate (all by default)."""
        return int(self.d_head * self.rotary_fraction)

    def uses_rotary(self, layer: int) -> bool:
        """Whether block `layer` rotates its queries and keys."""
        return self.pos_encoding == "rotary" and layer not in (self.no_rotary_layers or [])

    def rope_of(self, layer: int) -> tuple[float, dict | None]:
        """(rope_theta, rope_scaling) of block `layer`: the local ones on a windowed layer when the model has them."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta, self.rope_local_scaling
        return self.rope_theta, self.rope_scaling

    def window(self, layer: int) -> int | None:
        """The sliding window of block `layer` (keys a query sees, itself included), or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def scale(self) -> float:
        """The attention scale on q·k."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.d_head)

    @property
    def ff_width(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model
