"""A decoder-only Transformer built from the attention in `attention.py`: GPT-2 or Llama-style.

Blocks are pre-norm: x + Attn(Norm(x)), then x + FFN(Norm(x)); with `post_norms` (Gemma) each sublayer's
output is normalised again before the add, x + Norm(Attn(Norm(x))). The config chooses the pieces:
learned, sinusoidal or rotary positions (`rotary.py`), LayerNorm or RMSNorm (`norm.py`), a GELU, SwiGLU
or GeGLU feed-forward, grouped-query attention, biases, tied embeddings, a head width of its own and
query/key norms (`attention.py`), rotary positions on part of each head or in some blocks only, a sliding
window on some or all layers (with a rotary base of their own), scaled embeddings, the attention scale
and soft-capping of scores and logits. Parameter names map onto Hugging Face GPT-2 and Llama checkpoints
(see `hf/import_hf.py`); our Linear weights are (out, in).

`forward` takes optional `attention_mask` (B, past + T, 1 = attend), `position_ids` (B, T) and a
`BatchKVCache`, so a left-padded batch can be prefilled and then decoded one token at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import MultiHeadAttention, causal_mask, sliding_window_mask
from model.config import GPTConfig
from model.kv_cache import BatchKVCache
from model.norm import make_norm
from model.rotary import RotaryEmbedding, apply_rotary


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...), as in "Attention Is All You Need"."""
    pos = torch.arange(n_positions, dtype=torch.float32).unsqueeze(1)  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return table  # (P, d_model)


class FeedForward(nn.Module):
    """Position-wise MLP, d_model -> d_ff -> d_model: fc_out(GELU(fc_in(x))), or gated,
    fc_out(act(fc_gate(x)) * fc_in(x)): SwiGLU with SiLU (Llama's down(silu(gate) * up)), GeGLU with the
    config's GELU (Gemma)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gated = config.mlp in ("swiglu", "geglu")
        if self.gated:
            self.fc_gate = nn.Linear(config.d_model, config.ff_width, bias=config.bias)
        self.fc_in = nn.Linear(config.d_model, config.ff_width, bias=config.bias)
        self.fc_out = nn.Linear(config.ff_width, config.d_model, bias=config.bias)
        gelu = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.act = nn.SiLU() if config.mlp == "swiglu" else gelu
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc_gate(x)) * self.fc_in(x) if self.gated else self.act(self.fc_in(x))
        return self.dropout(self.fc_out(h))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        c = config
        self.window = c.window(layer)  # keys a query sees, itself included; None = every earlier one
        self.ln_1 = make_norm(c.norm, c.d_model, c.layer_norm_eps, c.bias)
        self.attn = MultiHeadAttention(c.d_model, c.n_head, c.attn_dropout, c.bias, d_head=c.d_head,
                                       n_kv_head=c.kv_heads, qkv_bias=c.qkv_bias,
                                       qk_norm_eps=c.layer_norm_eps if c.qk_norm else None,
                                       scale=c.attn_scale, softcap=c.attn_softcap)
        self.ln_2 = make_norm(c.norm, c.d_model, c.layer_norm_eps, c.bias)
        self.ffn = FeedForward(config)
        if c.post_norms:  # Gemma normalises each sublayer's output before the residual add
            self.post_attn_norm = make_norm(c.norm, c.d_model, c.layer_norm_eps, c.bias)
            self.post_ffn_norm = make_norm(c.norm, c.d_model, c.layer_norm_eps, c.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None, kv_cache: BatchKVCache | None, layer: int,
                rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`mask` is this block's: causal, within its window on a windowed layer (None: causal, no padding)."""
        q, k, v = self.attn.project_qkv(self.ln_1(x))  # q (B, H, T, D); k, v (B, H_kv, T, D)
        if rotary is not None:  # positions rotate queries and keys (the cache holds rotated keys)
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin).to(q.dtype), apply_rotary(k, cos, sin).to(k.dtype)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, H_kv, past + T, D)
        a = self.attn.attend(q, k, v, mask, is_causal=mask is None)  # (B, T, d_model)
        if hasattr(self, "post_attn_norm"):
            a = self.post_attn_norm(a)
        x = x + self.resid_dropout(a)
        f = self.ffn(self.ln_2(x))
        if hasattr(self, "post_ffn_norm"):
            f = self.post_ffn_norm(f)
        return x + f


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.rotary = None
        if config.pos_encoding == "learned":
            self.pos_emb = nn.Embedding(config.n_ctx, config.d_model)
        elif config.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(config.n_ctx, config.d_model), persistent=False)
        else:
            # the angles cover the rotated dimensions only: ω_i = theta^(-2i/rotary_dim), as HF Phi-3 computes them
            self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling, config.n_ctx)
            if config.rope_local_theta is not None:  # Gemma 3: the windowed layers' own base
                self.rotary_local = RotaryEmbedding(config.rotary_dim, config.rope_local_theta,
                                                    config.rope_local_scaling, config.n_ctx)
        if config.scale_embeddings:  # Gemma: sqrt(d_model) in the weights' dtype (a buffer follows .to(dtype))
            self.register_buffer("emb_scale", torch.tensor(math.sqrt(config.d_model)), persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config.norm, config.d_model, config.layer_norm_eps, config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # tied input and output embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("fc_out.weight"):
                # GPT-2: scale residual-branch outputs so the stream's variance does not grow with depth.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos_encoding == "learned":
            n -= self.pos_emb.weight.numel()
        return n

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> BatchKVCache:
        c = self.config
        p = self.tok_emb.weight
        return BatchKVCache(c.n_layer, batch_size, c.kv_heads, c.d_head, max_len or c.n_ctx, p.dtype, p.device)

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: BatchKVCache | None = None,
    ) -> Tensor:
        """input_ids (B, T) -> logits (B, T, vocab).

        attention_mask: (B, past + T), 1 where a token is real and 0 where it is padding.
        position_ids: (B, T); by default counted over real tokens when a mask is given.
        """
        B, T = input_ids.shape
        past = kv_cache.length if kv_cache is not None else 0
        total = past + T
        if total > self.config.n_ctx:
            raise ValueError(f"sequence of {total} positions exceeds the model context n_ctx={self.config.n_ctx}")
        if attention_mask is not None and attention_mask.shape != (B, total):
            raise ValueError(f"attention_mask must be (B, past + T) = {(B, total)}, got {tuple(attention_mask.shape)}")

        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
            else:
                position_ids = torch.arange(past, total, device=input_ids.device).expand(B, T)

        mask = None  # None lets attention take the fused causal path
        if attention_mask is not None or past > 0:
            mask = causal_mask(T, total, input_ids.device)[None, None]  # (1, 1, T, total)
            if attention_mask is not None:
                mask = mask & attention_mask.bool()[:, None, None, :]  # (B, 1, T, total)
        masks = {None: mask}  # by window; padding is on the left, so a key's distance in the row is its offset
        for window in {block.window for block in self.blocks} - {None}:
            masks[window] = sliding_window_mask(T, total, window, input_ids.device)[None, None]  # (1, 1, T, total)
            if attention_mask is not None:
                masks[window] = masks[window] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, total)

        x = self.tok_emb(input_ids)  # (B, T, d_model)
        if self.config.scale_embeddings:
            x = x * self.emb_scale
        rotary = rotary_local = None
        if self.rotary is not None:
            rotary = rotary_local = self.rotary(position_ids)
            if hasattr(self, "rotary_local"):
                rotary_local = self.rotary_local(position_ids)
        else:
            x = x + self.position_embedding(position_ids)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            positions = (rotary_local if block.window else rotary) if self.config.uses_rotary(i) else None
            x = block(x, masks[block.window], kv_cache, i, positions)
        if kv_cache is not None:
            kv_cache.advance(T)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def position_embedding(self, position_ids: Tensor) -> Tensor:
        if self.config.pos_encoding == "learned":
            return self.pos_emb(position_ids)
        return self.pos_table[position_ids]

    def loss(self, input_ids: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in nats; targets equal to -100 are ignored."""
        logits = self(input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
