"""Hugging Face Llama-family checkpoints (Llama, Qwen2, Mistral, Gemma 2) -> our config and parameter names.

The HF layout is already the rotate-half convention our rotary positions use, so no weight is
permuted: the query, key and value projections are stacked into `qkv_proj` (queries, then the KV
heads' keys, then their values), and every other tensor maps one to one:

    model.embed_tokens                       tok_emb
    model.layers.i.input_layernorm           blocks.i.ln_1            (RMSNorm)
    model.layers.i.self_attn.{q,k,v}_proj    blocks.i.attn.qkv_proj   (Qwen2: with biases)
    model.layers.i.self_attn.o_proj          blocks.i.attn.out_proj
    model.layers.i.post_attention_layernorm  blocks.i.ln_2
    model.layers.i.mlp.{gate,up,down}_proj   blocks.i.ffn.{fc_gate,fc_in,fc_out}
    model.norm                               ln_f
    lm_head                                  lm_head                  (absent when tied)

Gemma 2 differs in names and in its norms: post_attention_layernorm normalises the attention's output
(our post_attn_norm), pre_feedforward_layernorm is our ln_2 and post_feedforward_layernorm our
post_ffn_norm. Its RMSNorm computes x̂·(1 + w) in float32, so every norm weight is stored as w + 1 (in
float32, as Gemma adds it) and our one RMSNorm computes the same product; `export_hf` subtracts the 1.

Sliding windows: Mistral windows every layer when `sliding_window` is set; Qwen2 only with
`use_sliding_window`, then the layers `layer_types` names (by default those from `max_window_layers`
on); Gemma 2 the layers `layer_types` names (by default every other one, from the first).
"""

from __future__ import annotations

import torch

from model.config import GPTConfig
from model.rotary import rope_type

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                 "Gemma2ForCausalLM": "gemma2"}
BLOCK_MAP = [("input_layernorm.weight", "ln_1.weight"), ("self_attn.o_proj.weight", "attn.out_proj.weight"),
             ("post_attention_layernorm.weight", "ln_2.weight"), ("mlp.gate_proj.weight", "ffn.fc_gate.weight"),
             ("mlp.up_proj.weight", "ffn.fc_in.weight"), ("mlp.down_proj.weight", "ffn.fc_out.weight")]
GEMMA_BLOCK_MAP = [("input_layernorm.weight", "ln_1.weight"), ("self_attn.o_proj.weight", "attn.out_proj.weight"),
                   ("post_attention_layernorm.weight", "post_attn_norm.weight"),
                   ("pre_feedforward_layernorm.weight", "ln_2.weight"),
                   ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"),
                   ("mlp.gate_proj.weight", "ffn.fc_gate.weight"), ("mlp.up_proj.weight", "ffn.fc_in.weight"),
                   ("mlp.down_proj.weight", "ffn.fc_out.weight")]
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # HF's names for the tanh-approximated GELU


class Unsupported(ValueError):
    """A checkpoint option this decoder does not have; the message names it."""


def rope_settings(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either vintage: `rope_theta` + `rope_scaling`, or
    transformers 5's `rope_parameters`."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta") or params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    try:
        rope_type(scaling)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    return theta, scaling


def block_map(config: GPTConfig) -> list[tuple[str, str]]:
    """(HF name under a layer, our name under a block) for every tensor but q/k/v."""
    return GEMMA_BLOCK_MAP if config.post_norms else BLOCK_MAP


NORMS = ("ln_1", "ln_2", "post_attn_norm", "post_ffn_norm", "ln_f")  # our RMSNorms, whose weights Gemma offsets


def is_norm(name: str) -> bool:
    """Whether our parameter `name` is an RMSNorm's weight."""
    return name.split(".")[-2] in NORMS


def windows(hf: dict, kind: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers applies them to this family; (None, None) for none."""
    window = hf.get("sliding_window")
    if kind == "mistral":
        layer_types = None  # MistralForCausalLM windows every layer and ignores layer_types
    elif kind == "qwen2":
        if not hf.get("use_sliding_window"):
            return None, None
        layer_types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                                else "full_attention" for i in range(hf["num_hidden_layers"])]
    elif kind == "gemma2":
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                for i in range(hf["num_hidden_layers"])]
    else:
        return None, None
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None, None
    if window >= hf["max_position_embeddings"]:
        return None, None  # a window as long as the context is full attention
    return window, layer_types


def gemma_settings(hf: dict) -> dict:
    """GPTConfig fields of Gemma 2's extras; Unsupported names any option the decoder does not have."""
    if hf.get("use_bidirectional_attention"):
        raise Unsupported("use_bidirectional_attention is not supported (the decoder is causal)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in GELU_TANH:
        raise Unsupported(f"hidden_activation {hf['hidden_activation']!r} is not supported (GeGLU uses the tanh GELU)")
    return dict(mlp="geglu", activation="gelu_tanh", post_norms=True, scale_embeddings=True,
                attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"))


def config_from_hf(hf: dict, kind: str, eos_ids: list[int]) -> GPTConfig:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if kind == "gemma2":
        extras = gemma_settings(hf)
    else:
        if hf.get("hidden_act", "silu") != "silu":
            raise Unsupported(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
        extras = dict(mlp="swiglu")
    if hf.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise Unsupported(f"head_dim {hf.get('head_dim')} is not hidden_size / num_attention_heads")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise Unsupported("attention_bias / mlp_bias on every projection are not supported")
    window, layer_types = windows(hf, kind)
    theta, scaling = rope_settings(hf)
    return GPTConfig(
        vocab_size=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
        n_head=heads, n_kv_head=hf.get("num_key_value_heads") or heads, d_model=hidden, d_ff=hf["intermediate_size"],
        bias=False, qkv_bias=kind == "qwen2", layer_norm_eps=hf.get("rms_norm_eps", 1e-6), norm="rmsnorm",
        pos_encoding="rotary", rope_theta=theta, rope_scaling=scaling, sliding_window=window, layer_types=layer_types,
        tie_embeddings=bool(hf.get("tie_word_embeddings", kind == "gemma2")), eos_token_id=eos_ids[0],
        eos_token_ids=eos_ids if len(eos_ids) > 1 else None, bos_token_id=hf.get("bos_token_id"), **extras)


def convert_state_dict(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    s = {k: v.float() for k, v in hf_state.items()}
    out = {"tok_emb.weight": s["model.embed_tokens.weight"], "ln_f.weight": s["model.norm.weight"]}
    for i in range(config.n_layer):
        pre = f"model.layers.{i}."
        attn = pre + "self_attn."
        out[f"blocks.{i}.attn.qkv_proj.weight"] = torch.cat([s[attn + f"{p}_proj.weight"] for p in "qkv"])
        if config.qkv_bias:
            out[f"blocks.{i}.attn.qkv_proj.bias"] = torch.cat([s[attn + f"{p}_proj.bias"] for p in "qkv"])
        for hf_name, ours in block_map(config):
            out[f"blocks.{i}.{ours}"] = s[pre + hf_name]
    out["lm_head.weight"] = out["tok_emb.weight"] if config.tie_embeddings else s["lm_head.weight"]
    if config.post_norms:  # Gemma's x̂·(1 + w), in float32 as Gemma computes it
        out = {k: v + 1.0 if is_norm(k) else v for k, v in out.items()}
    return out
