"""The encoder-decoder Transformer of "Attention Is All You Need", from the attention in `attention.py`.

    encoder:  src (B, S) -> memory (B, S, d)       bidirectional self-attention, source padding masked
    cross:    memory -> per decoder layer K, V (B, H, S, D)     projected once per source
    decoder:  tgt (B, T) + cross K, V -> logits (B, T, vocab)   causal self-attention, then
              cross-attention (queries from the target, keys and values from the source), then FFN

An encoder layer is self-attention and a feed-forward; a decoder layer adds cross-attention between
the two. Post-LN (the paper, BART) normalises after each residual sum, x = Norm(x + F(x)); pre-LN
normalises each branch's input, x = x + F(Norm(x)), and ends each stack with a norm.

Masks follow `attention.py` (True = may attend). `src_mask` is (B, S) with 1 for a real source token
and 0 for padding, as Hugging Face's `attention_mask`: a padded source position gets zero weight in
the encoder's self-attention and in every cross-attention. The decoder's self-attention is causal.

Decoding keeps two caches: the self-attention keys and values grow by one position a step (a
`BatchKVCache`), and the cross-attention keys and values, computed by `cross_kv` once per source,
never change. `generate` is greedy decoding with both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import MultiHeadAttention, causal_mask
from model.gpt import sinusoidal_table
from model.kv_cache import BatchKVCache
from model.seq2seq_config import Seq2SeqConfig

CrossKV = list[tuple[Tensor, Tensor]]  # per decoder layer: keys and values of the source, each (B, H, S, D)

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh")}


class FeedForward(nn.Module):
    """fc_out(dropout(act(fc_in(x)))), d_model -> d_ff -> d_model."""

    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.fc_in = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.act = ACTIVATIONS[c.activation]()
        self.dropout = nn.Dropout(c.dropout)
        self.fc_out = nn.Linear(c.d_ff, c.d_model, bias=c.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.dropout(self.act(self.fc_in(x))))


class Sublayers(nn.Module):
    """The residual wiring both stacks share: post-LN Norm(x + F(x)) or pre-LN x + F(Norm(x))."""

    def __init__(self, c: Seq2SeqConfig, n: int):
        super().__init__()
        self.pre = c.norm_placement == "pre"
        self.norms = nn.ModuleList(nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias) for _ in range(n))
        self.dropout = nn.Dropout(c.dropout)

    def residual(self, i: int, x: Tensor, branch) -> Tensor:
        if self.pre:
            return x + self.dropout(branch(self.norms[i](x)))
        return self.norms[i](x + self.dropout(branch(x)))


class EncoderLayer(Sublayers):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__(c, 2)
        self.self_attn = MultiHeadAttention(c.d_model, c.n_head, c.attn_dropout, c.bias)
        self.ffn = FeedForward(c)

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        x = self.residual(0, x, lambda h: self.self_attn(h, attn_mask=keep))
        return self.residual(1, x, self.ffn)


class DecoderLayer(Sublayers):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__(c, 3)
        self.self_attn = MultiHeadAttention(c.d_model, c.n_head, c.attn_dropout, c.bias)
        self.cross_attn = MultiHeadAttention(c.d_model, c.n_head, c.attn_dropout, c.bias)
        self.ffn = FeedForward(c)

    def forward(self, x: Tensor, mask: Tensor | None, cross: tuple[Tensor, Tensor], keep: Tensor | None,
                kv_cache: BatchKVCache | None, layer: int) -> Tensor:
        def self_attention(h: Tensor) -> Tensor:
            q, k, v = self.self_attn.project_qkv(h)
            if kv_cache is not None:
                k, v = kv_cache.update(layer, k, v)
            return self.self_attn.attend(q, k, v, mask, is_causal=mask is None)

        def cross_attention(h: Tensor) -> Tensor:
            return self.cross_attn.attend(self.cross_attn.project_q(h), *cross, keep, is_causal=False)

        x = self.residual(0, x, self_attention)
        x = self.residual(1, x, cross_attention)
        return self.residual(2, x, self.ffn)


class EncoderDecoder(nn.Module):
    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        c = self.config = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)  # the encoder's, or both sides' when shared
        self.dec_tok_emb = None if c.share_embeddings else nn.Embedding(c.vocab_size, c.d_model)
        if c.pos_encoding == "sinusoidal":
            table = sinusoidal_table(max(c.n_src_ctx, c.n_tgt_ctx), c.d_model)
            self.register_buffer("pos_table", table, persistent=False)
        else:
            self.enc_pos_emb = nn.Embedding(c.n_src_ctx + c.position_offset, c.d_model)
            self.dec_pos_emb = nn.Embedding(c.n_tgt_ctx + c.position_offset, c.d_model)
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        if c.embedding_norm:
            self.enc_emb_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias)
            self.dec_emb_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.n_encoder_layer))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_decoder_layer))
        if c.norm_placement == "pre":  # a pre-LN stack's output is still unnormalised
            self.enc_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias)
            self.dec_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.final_logits_bias:
            self.register_buffer("logits_bias", torch.zeros(c.vocab_size))
        self.apply(self._init_weights)
        if c.tie_embeddings:
            self.lm_head.weight = self.decoder_embedding.weight

    def _init_weights(self, module: nn.Module) -> None:
        """Xavier-uniform matrices (the paper's reference code), zero biases, N(0, d^-1/2) embeddings."""
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.d_model ** -0.5)

    @property
    def decoder_embedding(self) -> nn.Embedding:
        return self.tok_emb if self.dec_tok_emb is None else self.dec_tok_emb

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _embed(self, ids: Tensor, positions: Tensor, side: str) -> Tensor:
        c = self.config
        emb = self.tok_emb if side == "enc" else self.decoder_embedding
        x = emb(ids) * self.embed_scale
        if c.pos_encoding == "sinusoidal":
            x = x + self.pos_table[positions]
        else:
            x = x + getattr(self, f"{side}_pos_emb")(positions + c.position_offset)
        if c.embedding_norm:
            x = getattr(self, f"{side}_emb_norm")(x)
        return self.drop(x)

    # ---- the encoder --------------------------------------------------------------------------------

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src_ids (B, S), src_mask (B, S) 1 = real token -> memory (B, S, d_model)."""
        B, S = src_ids.shape
        if S > self.config.n_src_ctx:
            raise ValueError(f"a source of {S} tokens exceeds the model's n_src_ctx={self.config.n_src_ctx}")
        x = self._embed(src_ids, torch.arange(S, device=src_ids.device).expand(B, S), "enc")
        keep = source_keep(src_mask)
        for layer in self.encoder:
            x = layer(x, keep)
        return self.enc_norm(x) if self.config.norm_placement == "pre" else x

    def cross_kv(self, memory: Tensor) -> CrossKV:
        """Every decoder layer's cross-attention keys and values of `memory`: once per source."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder]

    # ---- the decoder --------------------------------------------------------------------------------

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> BatchKVCache:
        c, p = self.config, self.tok_emb.weight
        return BatchKVCache(c.n_decoder_layer, batch_size, c.n_head, c.d_head, max_len or c.n_tgt_ctx,
                            p.dtype, p.device)

    def decode(self, tgt_ids: Tensor, cross: CrossKV, src_mask: Tensor | None = None,
               kv_cache: BatchKVCache | None = None) -> Tensor:
        """tgt_ids (B, T), written after the kv_cache's positions -> logits (B, T, vocab)."""
        B, T = tgt_ids.shape
        past = kv_cache.length if kv_cache is not None else 0
        if past + T > self.config.n_tgt_ctx:
            raise ValueError(f"a target of {past + T} tokens exceeds the model's n_tgt_ctx={self.config.n_tgt_ctx}")
        x = self._embed(tgt_ids, torch.arange(past, past + T, device=tgt_ids.device).expand(B, T), "dec")
        mask = causal_mask(T, past + T, tgt_ids.device)[None, None] if past else None  # None: fused causal
        keep = source_keep(src_mask)
        for i, layer in enumerate(self.decoder):
            x = layer(x, mask, cross[i], keep, kv_cache, i)
        if kv_cache is not None:
            kv_cache.advance(T)
        if self.config.norm_placement == "pre":
            x = self.dec_norm(x)
        logits = self.lm_head(x)
        return logits + self.logits_bias if self.config.final_logits_bias else logits

    def forward(self, src_ids: Tensor, tgt_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: logits (B, T, vocab) of every target position at once."""
        return self.decode(tgt_ids, self.cross_kv(self.encode(src_ids, src_mask)), src_mask)

    def loss(self, src_ids: Tensor, tgt_in: Tensor, tgt_out: Tensor, src_mask: Tensor | None = None,
             label_smoothing: float = 0.0) -> Tensor:
        """Mean cross-entropy of `tgt_out` given `tgt_in` (the decoder start + tgt_out[:-1]); -100 is ignored."""
        logits = self(src_ids, tgt_in, src_mask)
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=-100,
                               label_smoothing=label_smoothing)

    @torch.no_grad()
    def generate(self, src_ids: Tensor, src_mask: Tensor | None = None, max_new_tokens: int | None = None,
                 use_cache: bool = True) -> list[list[int]]:
        """Greedy targets of a batch of sources, each from the decoder start token to its EOS (kept) or
        `max_new_tokens`. Without `use_cache` every step reruns the decoder over the whole prefix."""
        c = self.config
        limit = min(max_new_tokens or c.n_tgt_ctx - 1, c.n_tgt_ctx - 1)
        B = src_ids.size(0)
        cross = self.cross_kv(self.encode(src_ids, src_mask))
        cache = self.new_kv_cache(B, limit + 1) if use_cache else None
        prefix = torch.full((B, 1), c.decoder_start_token_id, dtype=torch.long, device=src_ids.device)
        step_ids = prefix
        out: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
        for _ in range(limit):
            logits = self.decode(step_ids if use_cache else prefix, cross, src_mask, cache)[:, -1]
            nxt = logits.argmax(-1)
            for b in torch.nonzero(~done).flatten().tolist():
                out[b].append(int(nxt[b]))
            done |= nxt == c.eos_token_id
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            prefix = torch.cat([prefix, step_ids], dim=1)
        return out


def source_keep(src_mask: Tensor | None) -> Tensor | None:
    """(B, S) 1 = real token -> a (B, 1, 1, S) boolean mask, True where a query may attend to the key."""
    return None if src_mask is None else src_mask.bool()[:, None, None, :]
