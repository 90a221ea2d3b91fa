"""Hugging Face Llama-family checkpoints (Llama, Qwen2, Mistral, Qwen3, SmolLM3, Phi-3/4) -> our config and
parameter names.

The HF layout is already the rotate-half convention our rotary positions use, so no weight is
permuted: the query, key and value projections are stacked into `qkv_proj` (queries, then the KV
heads' keys, then their values), and every other tensor maps one to one:

    model.embed_tokens                       tok_emb
    model.layers.i.input_layernorm           blocks.i.ln_1            (RMSNorm)
    model.layers.i.self_attn.{q,k,v}_proj    blocks.i.attn.qkv_proj   (Qwen2: with biases)
    model.layers.i.self_attn.qkv_proj        blocks.i.attn.qkv_proj   (Phi-3: already fused in our order)
    model.layers.i.self_attn.{q,k}_norm      blocks.i.attn.{q,k}_norm (Qwen3)
    model.layers.i.self_attn.o_proj          blocks.i.attn.out_proj
    model.layers.i.post_attention_layernorm  blocks.i.ln_2
    model.layers.i.mlp.{gate,up,down}_proj   blocks.i.ffn.{fc_gate,fc_in,fc_out}
    model.layers.i.mlp.gate_up_proj          blocks.i.ffn.fc_gate, fc_in (Phi-3: gate rows, then up rows)
    model.norm                               ln_f
    lm_head                                  lm_head                  (absent when tied)

The families differ by configuration alone: Qwen3 has a head width of its own and query/key norms,
SmolLM3 blocks without rotary positions (its `no_rope_layers`, 1 = rotary), Phi-3/4 rotary on the
leading `partial_rotary_factor` of each head. `export_hf` writes each family back in its own layout.
"""

from __future__ import annotations

import torch

from model.config import GPTConfig
from model.rotary import rope_type

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                 "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3"}
BLOCK_MAP = [("input_layernorm.weight", "ln_1.weight"), ("self_attn.o_proj.weight", "attn.out_proj.weight"),
             ("post_attention_layernorm.weight", "ln_2.weight"), ("mlp.down_proj.weight", "ffn.fc_out.weight")]
SEPARATE_MLP = [("mlp.gate_proj.weight", "ffn.fc_gate.weight"), ("mlp.up_proj.weight", "ffn.fc_in.weight")]
QK_NORM_MAP = [("self_attn.q_norm.weight", "attn.q_norm.weight"), ("self_attn.k_norm.weight", "attn.k_norm.weight")]


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


def rotary_fraction(hf: dict) -> float:
    """Phi-3's partial_rotary_factor, top level or (transformers 5) in rope_parameters; 1.0 when absent."""
    factor = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor"))
    return 1.0 if factor is None else float(factor)


def no_rotary_layers(hf: dict, kind: str) -> list[int] | None:
    """SmolLM3's blocks without rotary positions: `no_rope_layers` holds 1 for a block that uses them (absent:
    every `no_rope_layer_interval`-th block, 4 by default, goes without, as transformers fills it in)."""
    if kind != "smollm3":
        return None
    layers = hf["num_hidden_layers"]
    uses = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(layers)]
    if len(uses) != layers:
        raise Unsupported(f"no_rope_layers has {len(uses)} entries for {layers} layers")
    return [i for i, use in enumerate(uses) if not use] or None


def head_dim(hf: dict) -> int | None:
    """The per-head width when it is not hidden_size / num_attention_heads (Qwen3), else None."""
    heads, hidden, width = hf["num_attention_heads"], hf["hidden_size"], hf.get("head_dim")
    if width is None:
        if hidden % heads:
            raise Unsupported(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and the "
                              "config sets no head_dim")
        return None
    return None if width * heads == hidden else width


def config_from_hf(hf: dict, kind: str, eos_ids: list[int]) -> GPTConfig:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise Unsupported("attention_bias / mlp_bias on every projection are not supported")
    n_ctx = hf["max_position_embeddings"]
    # Mistral and Phi-3 attend over `sliding_window` whenever it is set; the others only with use_sliding_window
    window = hf.get("sliding_window") if kind in ("mistral", "phi3") or hf.get("use_sliding_window") else None
    if window is not None and window < n_ctx:
        raise Unsupported(f"sliding_window {window} is shorter than the context ({n_ctx} positions); attention "
                          "over a sliding window is not supported")
    theta, scaling = rope_settings(hf)
    fraction = rotary_fraction(hf)
    return GPTConfig(
        vocab_size=hf["vocab_size"], n_ctx=n_ctx, n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, d_model=hidden, head_dim=head_dim(hf),
        qk_norm=kind == "qwen3", d_ff=hf["intermediate_size"], bias=False, qkv_bias=kind == "qwen2",
        layer_norm_eps=hf.get("rms_norm_eps", 1e-6), norm="rmsnorm", pos_encoding="rotary", rope_theta=theta,
        rope_scaling=scaling, rotary_fraction=fraction, no_rotary_layers=no_rotary_layers(hf, kind), mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_token_id=eos_ids[0],
        eos_token_ids=eos_ids if len(eos_ids) > 1 else None, bos_token_id=hf.get("bos_token_id"))


def block_map(config: GPTConfig) -> list[tuple[str, str]]:
    """(HF name, our name) under a block for every tensor mapped one to one, the stacked ones aside."""
    return BLOCK_MAP + (QK_NORM_MAP if config.qk_norm else [])


def convert_state_dict(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    s = hf_state
    out = {"tok_emb.weight": s["model.embed_tokens.weight"], "ln_f.weight": s["model.norm.weight"]}
    fused = "model.layers.0.self_attn.qkv_proj.weight" in s  # Phi-3
    for i in range(config.n_layer):
        pre = f"model.layers.{i}."
        attn = pre + "self_attn."
        if fused:  # rows already queries, keys, values; gate_up_proj rows gate, then up
            out[f"blocks.{i}.attn.qkv_proj.weight"] = s[attn + "qkv_proj.weight"]
            gate, up = s[pre + "mlp.gate_up_proj.weight"].chunk(2)
            out[f"blocks.{i}.ffn.fc_gate.weight"], out[f"blocks.{i}.ffn.fc_in.weight"] = gate, up
        else:
            out[f"blocks.{i}.attn.qkv_proj.weight"] = torch.cat([s[attn + f"{p}_proj.weight"] for p in "qkv"])
            for hf_name, ours in SEPARATE_MLP:
                out[f"blocks.{i}.{ours}"] = s[pre + hf_name]
        if config.qkv_bias:
            out[f"blocks.{i}.attn.qkv_proj.bias"] = torch.cat([s[attn + f"{p}_proj.bias"] for p in "qkv"])
        for hf_name, ours in block_map(config):
            out[f"blocks.{i}.{ours}"] = s[pre + hf_name]
    out["lm_head.weight"] = out["tok_emb.weight"] if config.tie_embeddings else s["lm_head.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}
