"""Hugging Face Llama-family checkpoints (Llama, Qwen2, Mistral, Qwen3, SmolLM3, Phi-3/4, Gemma 2, Gemma 3 text)
-> our config and parameter names.

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

Gemma 2 differs in names and in its norms: post_attention_layernorm normalises the attention's output
(our post_attn_norm), pre_feedforward_layernorm is our ln_2 and post_feedforward_layernorm our
post_ffn_norm. Its RMSNorm computes x̂·(1 + w) in float32, so every norm weight is stored as w + 1 (in
float32, as Gemma adds it) and our one RMSNorm computes the same product; `export_hf` subtracts the 1.
Gemma 3 (text) adds query/key norms of the same kind (offset alike) and a rotary per layer kind: the
sliding layers' base (`rope_local_base_freq`, or transformers 5's `rope_parameters["sliding_attention"]`)
becomes `rope_local_theta`.

Sliding windows: Mistral and Phi-3 window every layer when `sliding_window` is set (Phi-3's mask, too, lets
a query see `sliding_window` keys, itself included: Phi-3-mini-4k's 2047 is W = 2047); Qwen2 and Qwen3 only with
`use_sliding_window`, then the layers `layer_types` names (by default those from `max_window_layers` on);
SmolLM3 with `use_sliding_window`, the layers `layer_types` names (by default its blocks without rotary
positions); Gemma 2 and 3 the layers `layer_types` names (by default every other one from the first for Gemma 2,
all but every `sliding_window_pattern`-th, 6, for Gemma 3).
"""

from __future__ import annotations

import torch

from model.config import GPTConfig
from model.rotary import rope_type

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                 "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
BLOCK_MAP = [("input_layernorm.weight", "ln_1.weight"), ("self_attn.o_proj.weight", "attn.out_proj.weight"),
             ("post_attention_layernorm.weight", "ln_2.weight"), ("mlp.down_proj.weight", "ffn.fc_out.weight")]
GEMMA_BLOCK_MAP = [("input_layernorm.weight", "ln_1.weight"), ("self_attn.o_proj.weight", "attn.out_proj.weight"),
                   ("post_attention_layernorm.weight", "post_attn_norm.weight"),
                   ("pre_feedforward_layernorm.weight", "ln_2.weight"),
                   ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"),
                   ("mlp.down_proj.weight", "ffn.fc_out.weight")]
SEPARATE_MLP = [("mlp.gate_proj.weight", "ffn.fc_gate.weight"), ("mlp.up_proj.weight", "ffn.fc_in.weight")]
QK_NORM_MAP = [("self_attn.q_norm.weight", "attn.q_norm.weight"), ("self_attn.k_norm.weight", "attn.k_norm.weight")]
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # HF's names for the tanh-approximated GELU


class Unsupported(ValueError):
    """A checkpoint option this decoder does not have; the message names it."""


def rope_settings(hf: dict, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either vintage: `rope_theta` + `rope_scaling`, or
    transformers 5's `rope_parameters`. The scalings that read the original context get it as transformers
    does: Phi-3's top-level `original_max_position_embeddings` first, else max_position_embeddings."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta") or params.pop("rope_theta", default_theta))
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


def gemma3_rope(hf: dict) -> dict:
    """Gemma 3's rotary per layer kind as GPTConfig fields: transformers 5's `rope_parameters` by layer type, or
    the older `rope_theta` (global layers, default 1e6), `rope_scaling` and `rope_local_base_freq` (sliding
    layers, default 1e4, unscaled)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        context = {k: hf[k] for k in ("max_position_embeddings", "original_max_position_embeddings") if k in hf}
        theta, scaling = rope_settings({**context, "rope_parameters": params.get("full_attention")}, 1_000_000.0)
        local_theta, local_scaling = rope_settings({**context, "rope_parameters": params.get("sliding_attention")},
                                                   10_000.0)
    else:
        theta, scaling = rope_settings(hf, 1_000_000.0)
        local_theta, local_scaling = float(hf.get("rope_local_base_freq", 10_000.0)), None
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, rope_local_scaling=local_scaling)


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


# our RMSNorms, whose weights Gemma offsets
NORMS = ("ln_1", "ln_2", "post_attn_norm", "post_ffn_norm", "ln_f", "q_norm", "k_norm")


def is_norm(name: str) -> bool:
    """Whether our parameter `name` is an RMSNorm's weight."""
    return name.split(".")[-2] in NORMS


def smollm3_layer_types(hf: dict) -> list[str] | None:
    """SmolLM3's layer_types, None when no layer is windowed. transformers fills them in with the window on the
    blocks without rotary positions when use_sliding_window is on; layer_types written out are kept, and its
    masks then window them whatever use_sliding_window says while its flash-attention path windows them only
    with it on, so a checkpoint that names windowed layers with use_sliding_window off is refused."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        if not (hf.get("use_sliding_window") and hf.get("sliding_window") is not None):
            return None
        no_rope = no_rotary_layers(hf, "smollm3") or []
        layer_types = ["sliding_attention" if i in no_rope else "full_attention"
                       for i in range(hf["num_hidden_layers"])]
    if "sliding_attention" not in layer_types:
        return None
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") and window is not None and window >= hf["max_position_embeddings"]:
        return None  # windowed or not, attention covers the whole context
    if not hf.get("use_sliding_window") or window is None:
        raise Unsupported("layer_types names sliding_attention layers but use_sliding_window is off or "
                          "sliding_window unset (transformers' masks and its flash attention then disagree on "
                          "a SmolLM3, or it fails)")
    return layer_types


def windows(hf: dict, kind: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers applies them to this family; (None, None) for none."""
    window = hf.get("sliding_window")
    if kind == "mistral":
        layer_types = None  # MistralForCausalLM windows every layer and ignores layer_types
    elif kind == "phi3":
        layer_types = None  # Phi3ForCausalLM windows every layer whenever sliding_window is set, W keys as Mistral's
    elif kind in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window"):
            return None, None
        layer_types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                                else "full_attention" for i in range(hf["num_hidden_layers"])]
    elif kind == "smollm3":  # by default the window goes to the blocks without rotary positions
        layer_types = smollm3_layer_types(hf)
        if layer_types is None:
            return None, None
    elif kind in ("gemma2", "gemma3"):  # by default every 2nd (Gemma 2) or 6th (Gemma 3) layer is full
        pattern = 2 if kind == "gemma2" else hf.get("sliding_window_pattern", 6)
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                                for i in range(hf["num_hidden_layers"])]
    else:  # Llama has no window
        return None, None
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None, None
    if window >= hf["max_position_embeddings"]:
        return None, None  # a window as long as the context is full attention
    return window, layer_types


def gemma_settings(hf: dict) -> dict:
    """GPTConfig fields of Gemma 2's (and 3's) extras; Unsupported names any option the decoder does not have."""
    if hf.get("use_bidirectional_attention"):
        raise Unsupported("use_bidirectional_attention is not supported (the decoder is causal)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in GELU_TANH:
        raise Unsupported(f"hidden_activation {hf['hidden_activation']!r} is not supported (GeGLU uses the tanh GELU)")
    return dict(mlp="geglu", activation="gelu_tanh", post_norms=True, scale_embeddings=True,
                attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"))


def config_from_hf(hf: dict, kind: str, eos_ids: list[int]) -> GPTConfig:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if kind in ("gemma2", "gemma3"):
        extras = gemma_settings(hf)
    else:
        if hf.get("hidden_act", "silu") != "silu":
            raise Unsupported(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
        extras = dict(mlp="swiglu")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise Unsupported("attention_bias / mlp_bias on every projection are not supported")
    n_ctx = hf["max_position_embeddings"]
    window, layer_types = windows(hf, kind)
    if kind == "gemma3":  # a rotary per layer kind
        rope = gemma3_rope(hf)
    else:
        theta, scaling = rope_settings(hf)
        rope = dict(rope_theta=theta, rope_scaling=scaling)
    return GPTConfig(
        vocab_size=hf["vocab_size"], n_ctx=n_ctx, n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, d_model=hidden, head_dim=head_dim(hf),
        qk_norm=kind in ("qwen3", "gemma3"), d_ff=hf["intermediate_size"], bias=False, qkv_bias=kind == "qwen2",
        layer_norm_eps=hf.get("rms_norm_eps", 1e-6), norm="rmsnorm", pos_encoding="rotary", **rope,
        rotary_fraction=rotary_fraction(hf), no_rotary_layers=no_rotary_layers(hf, kind),
        sliding_window=window, layer_types=layer_types,
        tie_embeddings=bool(hf.get("tie_word_embeddings", kind.startswith("gemma"))), eos_token_id=eos_ids[0],
        eos_token_ids=eos_ids if len(eos_ids) > 1 else None, bos_token_id=hf.get("bos_token_id"), **extras)


def block_map(config: GPTConfig) -> list[tuple[str, str]]:
    """(HF name, our name) under a block for every tensor mapped one to one, the stacked ones aside."""
    return (GEMMA_BLOCK_MAP if config.post_norms else BLOCK_MAP) + (QK_NORM_MAP if config.qk_norm else [])


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
    out = {k: v.float().contiguous() for k, v in out.items()}
    if config.post_norms:  # Gemma's x̂·(1 + w), in float32 as Gemma computes it
        out = {k: v + 1.0 if is_norm(k) else v for k, v in out.items()}
    return out
