"""Hugging Face Llama-family checkpoints (Llama, Qwen2, Mistral) -> our config and parameter names.

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
"""

from __future__ import annotations

import torch

from model.config import GPTConfig
from model.rotary import rope_type

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
BLOCK_MAP = [("input_layernorm.weight", "ln_1.weight"), ("self_attn.o_proj.weight", "attn.out_proj.weight"),
             ("post_attention_layernorm.weight", "ln_2.weight"), ("mlp.gate_proj.weight", "ffn.fc_gate.weight"),
             ("mlp.up_proj.weight", "ffn.fc_in.weight"), ("mlp.down_proj.weight", "ffn.fc_out.weight")]


class Unsupported(ValueError):
    """A checkpoint option this decoder does not have; the message names it."""


def rope_settings(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either vintage: `rope_theta` + `rope_scaling`, or
    transformers 5's `rope_parameters`. The scalings that read the original context get it as transformers
    does: Phi-3's top-level `original_max_position_embeddings` first, else max_position_embeddings."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta") or params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    try:
        kind = rope_type(scaling)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    if kind in ("llama3", "yarn", "longrope"):
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling = {**scaling, "original_max_position_embeddings": original or hf["max_position_embeddings"]}
    return theta, scaling


def config_from_hf(hf: dict, kind: str, eos_ids: list[int]) -> GPTConfig:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    if hf.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise Unsupported(f"head_dim {hf.get('head_dim')} is not hidden_size / num_attention_heads")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise Unsupported("attention_bias / mlp_bias on every projection are not supported")
    n_ctx = hf["max_position_embeddings"]
    window = hf.get("sliding_window") if kind == "mistral" or hf.get("use_sliding_window") else None
    if window is not None and window < n_ctx:
        raise Unsupported(f"sliding_window {window} is shorter than the context ({n_ctx} positions); attention "
                          "over a sliding window is not supported")
    theta, scaling = rope_settings(hf)
    return GPTConfig(
        vocab_size=hf["vocab_size"], n_ctx=n_ctx, n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, d_model=hidden, d_ff=hf["intermediate_size"],
        bias=False, qkv_bias=kind == "qwen2", layer_norm_eps=hf.get("rms_norm_eps", 1e-6), norm="rmsnorm",
        pos_encoding="rotary", rope_theta=theta, rope_scaling=scaling, mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_token_id=eos_ids[0],
        eos_token_ids=eos_ids if len(eos_ids) > 1 else None, bos_token_id=hf.get("bos_token_id"))


def convert_state_dict(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    s = hf_state
    out = {"tok_emb.weight": s["model.embed_tokens.weight"], "ln_f.weight": s["model.norm.weight"]}
    for i in range(config.n_layer):
        pre = f"model.layers.{i}."
        attn = pre + "self_attn."
        out[f"blocks.{i}.attn.qkv_proj.weight"] = torch.cat([s[attn + f"{p}_proj.weight"] for p in "qkv"])
        if config.qkv_bias:
            out[f"blocks.{i}.attn.qkv_proj.bias"] = torch.cat([s[attn + f"{p}_proj.bias"] for p in "qkv"])
        for hf_name, ours in BLOCK_MAP:
            out[f"blocks.{i}.{ours}"] = s[pre + hf_name]
    out["lm_head.weight"] = out["tok_emb.weight"] if config.tie_embeddings else s["lm_head.weight"]
    return {k: v.float() for k, v in out.items()}
